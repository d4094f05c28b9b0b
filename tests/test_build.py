"""build_info, available_backends and the error for a backend that is not there."""

import pytest
import torch

import dtp_kernels
from dtp_kernels import _extension
from utils import CUDA


def test_build_info_keys():
    info = dtp_kernels.build_info()
    for key in (
        "torch",
        "triton",
        "cuda_compiled",
        "cuda_arch_list",
        "compiler",
        "extension_loaded",
    ):
        assert key in info
    assert info["torch"] == torch.__version__
    if info["extension_loaded"]:
        assert info["compiler"] and info["torch_compiled_against"] == torch.__version__
        assert info["cuda_toolchain_at_build"] in (True, False)
        assert info["build_cuda_setting"] in ("0", "1", "auto")


def test_available_backends_cpu():
    backends = dtp_kernels.available_backends("cpu")
    assert backends[:2] == ["reference", "torch"]
    assert ("cpu" in backends) == _extension.compiled()


def test_missing_extension_message(monkeypatch):
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "_C_ERROR", ImportError("no module named dtp_kernels._C"))
    assert "cpu" not in dtp_kernels.available_backends("cpu")
    state = dtp_kernels.TransportState([3])
    with pytest.raises(dtp_kernels.BackendUnavailableError, match=r"make build"):
        dtp_kernels.transport_mask(torch.randn(3), [1.0], state, backend="cpu")
    # "auto" falls back to what is there
    mask = dtp_kernels.transport_mask(torch.randn(3), [1.0], state, backend="auto")
    assert mask.shape == (3,)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton" not in dtp_kernels.available_backends("cpu")
    with pytest.raises(dtp_kernels.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        dtp_kernels.transport_mask(
            torch.randn(3), [1.0], dtp_kernels.TransportState([3]), backend="triton"
        )


def test_auto_picks_compiled_kernel_on_cpu():
    if not _extension.compiled():
        pytest.skip("dtp_kernels._C is not built")
    assert dtp_kernels.available_backends("cpu")[-1] == "cpu"


@pytest.mark.slow
def test_package_imports_without_extension(tmp_path):
    """Importing never fails because the compiled module is missing."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    src = Path(dtp_kernels.__file__).parent
    copy = tmp_path / "dtp_kernels"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = (
        "import dtp_kernels as d; "
        "print(d.available_backends('cpu'), d.build_info()['extension_loaded'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    backends, loaded = out.stdout.strip().rsplit(" ", 1)
    assert "'cpu'" not in backends and backends.startswith("['reference', 'torch'")
    assert loaded == "False"


def test_cuda_sources_compiled_when_toolchain_present():
    """With a CUDA build of torch and nvcc at build time, `make` compiles and links the
    CUDA kernels, so a CUDA source that does not compile fails CI even on a machine
    without a GPU. Reads what the build recorded, not this process's environment."""
    if not _extension.compiled():
        pytest.skip("dtp_kernels._C is not built")
    recorded = dtp_kernels.build_info()
    if not recorded["cuda_toolchain_at_build"] or recorded["build_cuda_setting"] == "0":
        pytest.skip(f"the build had no CUDA toolchain or was told not to use it ({recorded})")
    info = dtp_kernels.build_info()
    assert info["cuda_compiled"] is True
    assert info["cuda_arch_list"]
    # the CUDA kernels are registered under the CUDA dispatch key of the same ops
    for op in ("transport_mask", "transport_mask_backward", "masked_channel_epilogue"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dtp::{op}", "CUDA")


def test_cuda_backend_error_without_cuda_tensors():
    with pytest.raises(dtp_kernels.BackendUnavailableError, match="backend 'cuda'"):
        dtp_kernels.transport_mask(
            torch.randn(3), [1.0], dtp_kernels.TransportState([3]), backend="cuda"
        )


def test_auto_on_cuda_prefers_the_cuda_kernels():
    """available_backends() on a CUDA device puts the CUDA kernels last ("auto") when they
    are built, Triton otherwise; it needs no GPU to decide."""
    from dtp_kernels import _extension

    backends = _extension.available_backends("cuda")
    assert backends[:2] == ["reference", "torch"]
    if _extension.cuda_compiled():
        assert backends[-1] == "cuda"
    elif _extension.triton_installed():
        assert backends[-1] == "triton"


@pytest.mark.cuda
def test_triton_is_available_and_auto_on_cuda():
    assert "triton" in dtp_kernels.available_backends(CUDA)
    assert dtp_kernels.available_backends(CUDA)[-1] in ("triton", "cuda")
