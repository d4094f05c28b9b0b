"""Loading of the compiled module, and what each backend needs to run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch

try:
    from . import _C

    _C_ERROR: Exception | None = None
except ImportError as error:  # the package stays importable without its build
    _C = None  # type: ignore[assignment]  # (mypy types a module, not an optional one)
    _C_ERROR = error

BUILD_HINT = (
    "build it with `make build` (or `pip install --no-build-isolation -e .`) in the "
    "repository, with torch installed"
)

BACKENDS = ("auto", "reference", "torch", "cpu", "triton", "cuda")

# "auto" on a CUDA device picks the CUDA kernels when they are built, Triton otherwise:
# CUDA was faster in every case measured. NVIDIA H100 80GB HBM3, torch 2.11, Triton 3.6,
# 2026-11-26 (benchmarks/results/{transport,epilogue,scaling}_cuda.md): the mask step of
# ResNet-50's 32 groups fwd + bwd 268 us vs 528 us, the epilogue fwd 0.08 ms vs 0.22 ms,
# one 1e7-element segment 1.2 ms vs 137 ms. NVIDIA H200, same versions
# (results/{transport,epilogue}_cuda_h200.md): 269 us vs 701 us, the epilogue fwd 2.9-3.2x.


class BackendUnavailableError(RuntimeError):
    """A backend was asked for that cannot run here; the message says how to get it."""


def compiled() -> bool:
    """Whether dtp_kernels._C imported."""
    return _C is not None


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def triton_interpreted() -> bool:
    """Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (tests, CI)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Read once: torch.compile cannot trace into the pybind function, and it never changes.
_CUDA_COMPILED = _C is not None and bool(_C.build_info()["cuda_compiled"])


def cuda_compiled() -> bool:
    return _CUDA_COMPILED


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on tensors of `device`; "auto" picks the last one.

    CPU: reference, torch, triton (interpreted, only with TRITON_INTERPRET=1), cpu.
    CUDA: reference, torch, then cuda and triton (when built / installed), ordered so the
    last is the CUDA kernels' when they are built, else Triton's.
    """
    device = torch.device(device)
    backends = ["reference", "torch"]
    if device.type == "cuda":
        fused = []
        if triton_installed():
            fused.append("triton")
        if cuda_compiled():
            fused.append("cuda")  # last: what "auto" picks (see the measurements above)
        return backends + fused
    if device.type == "cpu" and triton_installed() and triton_interpreted():
        backends.append("triton")
    if device.type == "cpu" and compiled():
        backends.append("cpu")
    return backends


def require_backend(backend: str, device: torch.device) -> None:
    """Raise BackendUnavailableError with instructions when `backend` cannot run on `device`."""
    if backend in available_backends(device):
        return
    if backend == "cuda":
        reason = (
            f"it runs on CUDA tensors, got tensors on {device}"
            if device.type != "cuda"
            else "dtp_kernels._C was built without CUDA kernels; rebuild with a CUDA build of "
            "torch and nvcc on the PATH (or DTP_BUILD_CUDA=1)"
        )
        raise BackendUnavailableError(f"backend 'cuda' is not available: {reason}")
    if backend == "cpu" and device.type != "cpu":
        raise BackendUnavailableError(
            f"backend 'cpu' runs on CPU tensors, got tensors on {device}; "
            f"use one of {available_backends(device)} there"
        )
    if backend == "cpu":
        raise BackendUnavailableError(
            f"backend 'cpu' needs the compiled module dtp_kernels._C, which did not import "
            f"({_C_ERROR}); {BUILD_HINT}"
        )
    if backend == "triton":
        how = (
            "install triton (pip install triton)"
            if not triton_installed()
            else "use CUDA tensors, or set TRITON_INTERPRET=1 before importing dtp_kernels "
            "to interpret the kernels on the CPU (slow; for tests)"
        )
        raise BackendUnavailableError(f"backend 'triton' is not available on {device}: {how}")
    raise BackendUnavailableError(
        f"backend {backend!r} is not available on {device}; available: {available_backends(device)}"
    )


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_info() -> dict:
    """Versions of torch and triton and how dtp_kernels._C was compiled.

    Keys: torch, triton, cuda_compiled, cuda_arch_list, compiler, torch_compiled_against,
    cuda_toolchain_at_build (a CUDA torch and nvcc were there when _C was built),
    build_cuda_setting (DTP_BUILD_CUDA then: "0", "1" or "auto"), extension_loaded,
    extension_error.
    """
    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "extension_loaded": compiled(),
        "extension_error": None if _C_ERROR is None else str(_C_ERROR),
        "cuda_compiled": False,
        "cuda_arch_list": "",
        "compiler": None,
        "torch_compiled_against": None,
        "cuda_toolchain_at_build": None,
        "build_cuda_setting": None,
    }
    if _C is not None:
        info.update(_C.build_info())
    return info


def set_cpu_huge_pages(enabled: bool) -> bool:
    """Whether the CPU kernels ask Linux for transparent huge pages (2 MiB) for the new
    memory of outputs of 4 MiB or more; on by default. Returns the previous setting.

    Fresh memory is mapped page by page as a kernel first writes it; with 4 KiB pages a
    mask step over 1e7 weights took 1.2x as long on a 2-core CPU (docs/benchmarks.md).
    The advice needs transparent huge pages in "madvise" or "always" mode
    (/sys/kernel/mm/transparent_hugepage/enabled) and is a no-op elsewhere; turn it off
    where THP compaction stalls a system. Memory the output cache holds
    (:func:`set_cpu_output_cache`) is reused only under the setting it was made with.
    Without the compiled module there is nothing to advise and this returns False.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_cpu_huge_pages: enabled must be a bool, got {enabled!r}")
    if _C is None:
        return False
    return _C.set_huge_page_outputs(enabled)


def set_cpu_output_cache(limit_bytes: int) -> int:
    """How many bytes of freed output memory the CPU kernels keep for reuse (1 GiB by
    default; 0 keeps none and frees what is held now). Returns the previous limit.

    Outputs of 4 MiB or more (masks, gradients, the statistics a step keeps for its
    backward) take their memory from blocks that earlier outputs of the same rounded size
    freed, as CUDA's caching allocator does on GPUs: glibc hands every freed block above
    32 MiB back to the OS, and with fresh pages mapped and zeroed for every output a 2:4
    step over 1e7 weights on a 2-core CPU reached 0.32 of copy bandwidth, with the cache
    0.35-0.51 in two runs (docs/benchmarks.md). A block goes back to the cache only when
    the last tensor using it is freed, so a live tensor's memory is never handed out
    twice; when a freed block does not fit under the limit, the blocks freed longest ago
    make room. The memory held counts in the process's resident size: lower the limit
    where that matters. Without the compiled module there is no cache and this returns 0.
    """
    if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool):
        raise TypeError(f"set_cpu_output_cache: limit_bytes must be an int, got {limit_bytes!r}")
    if limit_bytes < 0:
        raise ValueError(f"set_cpu_output_cache: limit_bytes = {limit_bytes}; it must be >= 0")
    if _C is None:
        return 0
    return _C.set_output_cache_limit(limit_bytes)


def cpu_output_cache_info() -> dict[str, int]:
    """The CPU output cache now: ``held_bytes`` and ``held_blocks`` (freed memory kept for
    reuse) and ``limit_bytes`` (:func:`set_cpu_output_cache`); all 0 without the compiled
    module."""
    if _C is None:
        return {"held_bytes": 0, "held_blocks": 0, "limit_bytes": 0}
    held_bytes, held_blocks, limit_bytes = _C.output_cache_info()
    return {"held_bytes": held_bytes, "held_blocks": held_blocks, "limit_bytes": limit_bytes}
