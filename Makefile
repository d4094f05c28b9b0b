# Set-up on a fresh machine: `make demo` runs the main job, `make test` passes the tests.
# Both create or reuse .venv, install the pinned dependencies in one pip command and build
# the extension (incrementally, with ninja) before running.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
CSRC := $(wildcard csrc/*.h csrc/*.cuh csrc/*.cpp csrc/*.cu)

.PHONY: all venv build test test-fast check-wheel demo demo-transformers lint format bench clean

all: test

$(INSTALLED): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(INSTALLED)

build: $(INSTALLED)
	$(PY) setup.py --quiet build_ext --inplace

# pytest-xdist: one worker per core (two on CI)
test: build
	$(PY) -m pytest -q -n auto tests

# The inner loop: everything but the end-to-end, subprocess and interpreted-Triton tests.
test-fast: build
	$(PY) -m pytest -q -n auto -m "not slow" tests

# the wheel, compiled and pure Python, installed and run from outside the checkout
check-wheel: build
	bash tools/check_wheel.sh

demo: build
	$(PY) -m dtp_kernels.demo

# DTP on a small ViT (digits) and a small Llama (stdlib source), against L1; offline
demo-transformers: build
	$(PY) -m dtp_kernels.transformer_demo

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CSRC)
	$(VENV)/bin/mypy

format: $(INSTALLED)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CSRC)

bench: build
	$(PY) benchmarks/bench_transport.py

clean:
	rm -rf build dtp_kernels/*.so
