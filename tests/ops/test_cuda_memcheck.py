"""compute-sanitizer memcheck over one run of each CUDA kernel (both ops, fused and split
schedules, NCHW and channels_last): no out-of-bounds or misaligned access."""

import pytest

from utils import checkout_environment, cuda_backends

SANITIZED = """
import torch, dtp_kernels as d
c = torch.device("cuda")
st = d.TransportState([1, 3, 1025, 70000], device=c)
s = torch.randn(71029, device=c, requires_grad=True)
for iters in (1, 3):
    m = d.transport_mask(s, [1.0, 1.5, 10.0, 3000.0], st, iters=iters, backend="cuda")
    m.square().sum().backward()
for fmt in (torch.contiguous_format, torch.channels_last):
    y = torch.randn(3, 5, 7, 9, device=c).to(memory_format=fmt).requires_grad_(True)
    mask = torch.rand(5, device=c, requires_grad=True)
    bias = torch.randn(5, device=c)
    d.masked_channel_epilogue(y, mask, bias, "relu", backend="cuda").sum().backward()
torch.cuda.synchronize()
"""


@pytest.mark.cuda
def test_compute_sanitizer_memcheck_clean():
    """compute-sanitizer memcheck on one run of each CUDA kernel."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if "cuda" not in cuda_backends():
        pytest.skip("the CUDA kernels are not built")
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(tool).exists():
        pytest.skip("compute-sanitizer not found")
    env = checkout_environment()
    result = subprocess.run(
        [tool, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", SANITIZED],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout + result.stderr
