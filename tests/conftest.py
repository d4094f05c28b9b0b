"""Shared fixtures. TRITON_INTERPRET must be set before any @triton.jit runs, so first.

Without a GPU, Triton runs under its interpreter on CPU tensors; with one, Triton compiles
for the GPU (tests/test_gpu.py) and the CPU tests leave Triton out.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import dtp_kernels

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Backends that run on CPU tensors here, besides the reference oracle.
FAST_CPU_BACKENDS = [b for b in dtp_kernels.available_backends("cpu") if b != "reference"]
ALL_CPU_BACKENDS = dtp_kernels.available_backends("cpu")

# (n, k) per segment: ragged sizes, k from 0 to n with both ends, fractional k.
RAGGED_LAYOUT = [
    (1, 0.0),
    (1, 1.0),
    (2, 0.0),
    (2, 1.0),
    (2, 2.0),
    (3, 1.5),
    (3, 3.0),
    (17, 0.0),
    (17, 5.0),
    (17, 17.0),
    (1023, 511.5),
    (1025, 1.0),
    (4096, 1000.0),
    (4096, 4096.0),
]


@pytest.fixture(params=FAST_CPU_BACKENDS)
def fast_backend(request) -> str:
    return request.param


@pytest.fixture(params=ALL_CPU_BACKENDS)
def any_backend(request) -> str:
    return request.param


def pytest_collection_modifyitems(items) -> None:
    """Every case of the interpreted Triton backend is slow (~2 ms per program instance):
    `make test-fast` leaves them out, the full suite runs them."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "triton" in callspec.params.values():
            item.add_marker(pytest.mark.slow)
