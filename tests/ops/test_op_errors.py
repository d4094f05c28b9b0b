"""The compiled ops, called directly with bad input, raise a RuntimeError naming the
argument in the caller's process, on every device. Each call runs in a child process, so
that a crash fails one case with its signal instead of taking the test worker down: on an
H200 (torch 2.11, 2026-12-04) every error thrown by the CUDA ops ended the process with
SIGSEGV, both from the .cu files' host code (run 12b) and, after the checks moved there,
from csrc/cuda_entry_points.cpp, which the C++ compiler builds (run 13;
benchmarks/results/gpu_tests_cuda.md). The CPU cases pass on that machine."""

import subprocess
import sys

import pytest

import dtp_kernels
from utils import checkout_environment

SETUP = """
import torch
import dtp_kernels
d = {device!r}
nseg = 37
scores = torch.rand(nseg * 4, device=d)
offsets = torch.arange(nseg + 1, device=d) * 4
keep = torch.full((nseg,), 2.0, device=d)
eps = torch.full((nseg,), 0.5, dtype=torch.float64, device=d)
log_odds, shift = torch.zeros(nseg * 4, device=d), torch.zeros(nseg, device=d)
grad = torch.randn(nseg * 4, device=d)
y = torch.randn(2, 4, 3, 3, device=d)
op, backward = torch.ops.dtp.transport_mask, torch.ops.dtp.transport_mask_backward
try:
    {call}
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
"""

# (name, the call, the message it must raise): the mask step's forward and both kernels'
# backwards, the epilogue's forward and backward
CALLS = [
    (
        "segment-size",
        "op(scores, offsets, keep, eps, log_odds, shift, 1, False, 0, 5)",
        "segment_size must be 0",
    ),
    (
        "tile-stats-dtype",
        "backward(grad, scores, offsets, keep, eps, log_odds, "
        "op(scores, offsets, keep, eps, log_odds, shift, 1, False, 0, 4)[3].double(), "
        "False, 0, 4)",
        "stats must be",
    ),
    (
        "general-grad-size",
        "backward(grad[:5], scores, offsets, keep, eps, log_odds, "
        "op(scores, offsets, keep, eps, log_odds, shift, 1, False, 1, 4)[3], False, 1, 4)",
        "grad_mask has 5 elements",
    ),
    (
        "epilogue-mask-size",
        "torch.ops.dtp.masked_channel_epilogue(y, torch.ones(3, device=d), None, 'relu', 1)",
        "mask must be a 1-D floating tensor of 4 channels",
    ),
    (
        "epilogue-backward-grad-shape",
        "torch.ops.dtp.masked_channel_epilogue_backward("
        "y[:1], y, torch.ones(4, device=d), None, 'relu', 1)",
        "grad_out has shape",
    ),
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("name, call, message", CALLS, ids=[c[0] for c in CALLS])
@pytest.mark.parametrize("device", DEVICES)
def test_a_direct_call_with_bad_input_raises_in_the_callers_process(device, name, call, message):
    backend = "cpu" if device == "cpu" else "cuda"
    if backend not in dtp_kernels.available_backends(device):
        pytest.skip(f"the {backend} kernels are not built")
    code = SETUP.format(device=device, call=call)
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=checkout_environment(),
    )
    assert child.returncode == 0, (
        f"the process ended with {child.returncode}: {child.stderr[-2000:]}"
    )
    assert "raised: dtp::" in child.stdout and message in child.stdout, child.stdout
