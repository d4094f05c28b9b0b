"""Shared fixtures. TRITON_INTERPRET must be set before any @triton.jit runs, so first.

Without a GPU, Triton runs under its interpreter on CPU tensors; with one, Triton compiles
for the GPU and the CPU tests leave Triton out. Tests and parameters marked `cuda` run
on a GPU and skip without one (`pytest -m cuda` runs just them).
"""

import hashlib
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# Two threads, or one per worker when pytest-xdist runs several workers on the cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))

from utils import ALL_CPU_BACKENDS, FAST_CPU_BACKENDS, require_backend  # noqa: E402


def build_tag() -> str:
    """A name for this build of dtp_kernels (its sources and extension, by size and
    modification time). torch.compile's caches do not key on a custom op's metadata: a
    graph cached under an earlier build (an output of another dtype, say) would be reused
    and fail, so the tests key them on the build (subprocesses through the environment)."""
    digest = hashlib.sha1()
    for path in sorted((Path(__file__).resolve().parents[1] / "dtp_kernels").rglob("*")):
        if path.suffix in (".py", ".so"):
            stat = path.stat()
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return "dtp-kernels-" + digest.hexdigest()[:16]


os.environ["TORCH_COMPILE_CACHE_KEY_TAG"] = build_tag()
torch.compiler.config.cache_key_tag = os.environ["TORCH_COMPILE_CACHE_KEY_TAG"]


@pytest.fixture(params=FAST_CPU_BACKENDS)
def fast_backend(request) -> str:
    return request.param


@pytest.fixture(params=ALL_CPU_BACKENDS)
def any_backend(request) -> str:
    return request.param


# (device, backend): the fast CPU backends, then the GPU ones
DEVICE_BACKENDS = [pytest.param(("cpu", b), id=f"cpu-{b}") for b in FAST_CPU_BACKENDS] + [
    pytest.param(("cuda", b), id=f"cuda-{b}", marks=pytest.mark.cuda) for b in ("triton", "cuda")
]


@pytest.fixture(params=DEVICE_BACKENDS)
def device_backend(request) -> tuple[str, str]:
    """Every device here with each of its fast backends; one test body for all."""
    device, backend = request.param
    require_backend(backend, device)
    return device, backend


def pytest_collection_modifyitems(items) -> None:
    """Every case of the interpreted Triton backend is slow (~2 ms per program instance):
    `make test-fast` leaves them out, the full suite runs them. Tests marked `cuda` skip
    without a GPU."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            if not torch.cuda.is_available():
                item.add_marker(no_gpu)
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        values = [
            v for p in callspec.params.values() for v in (p if isinstance(p, tuple) else (p,))
        ]
        if "triton" in values:
            item.add_marker(pytest.mark.slow)
