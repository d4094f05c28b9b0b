"""Shared fixtures. TRITON_INTERPRET must be set before any @triton.jit runs, so first.

Without a GPU, Triton runs under its interpreter on CPU tensors; with one, Triton compiles
for the GPU (tests/test_gpu.py) and the CPU tests leave Triton out.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from utils import ALL_CPU_BACKENDS, FAST_CPU_BACKENDS  # noqa: E402 - after the env


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
