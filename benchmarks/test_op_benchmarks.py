"""The ops under pytest-benchmark, the way kernel users track regressions:

    pytest benchmarks/ --benchmark-only --benchmark-autosave          # save a run
    pytest benchmarks/ --benchmark-only --benchmark-compare \\
        --benchmark-compare-fail=median:10%                           # gate on the last one

Runs on CUDA when a GPU is present, else on the CPU (the interpreted Triton backend is no
CPU path and is left out). Ratios between providers still come from the interleaved
scripts (bench_transport.py, bench_epilogue.py); this file tracks each one over time.
"""

from __future__ import annotations

import pytest
import torch

import dtp_kernels
from dtp_kernels import masked_channel_epilogue
from dtp_kernels.benchmarking import RESNET50_GROUPS, mask_step, sync

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = [
    b
    for b in dtp_kernels.available_backends(DEVICE)
    if b != "reference" and not (DEVICE.type == "cpu" and b == "triton")
]


def timed(fn):
    """`fn`, then a device sync: the benchmark measures the work, not its launch."""

    def call():
        fn()
        sync(DEVICE)

    return call


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fwd", "full"])
def test_transport_mask(benchmark, backend, mode):
    """The mask step over ResNet-50's 32 groups (7,552 channels, ratio 0.6)."""
    benchmark.group = f"transport_mask {mode} {DEVICE.type}"
    step = mask_step(backend, RESNET50_GROUPS, DEVICE, backward=mode == "full")
    benchmark(timed(step))


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_channel_epilogue(benchmark, backend):
    """relu((y + bias) * mask) forward and backward on (64, 256, 28, 28) fp32."""
    benchmark.group = f"masked_channel_epilogue full {DEVICE.type}"
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(64, 256, 28, 28, generator=gen).to(DEVICE).requires_grad_(True)
    mask = torch.rand(256, generator=gen).to(DEVICE).requires_grad_(True)
    bias = torch.randn(256, generator=gen).to(DEVICE).requires_grad_(True)
    grad = torch.randn(64, 256, 28, 28, generator=gen).to(DEVICE)

    def full():
        out = masked_channel_epilogue(y, mask, bias, "relu", backend=backend)
        torch.autograd.grad(out, (y, mask, bias), grad)

    benchmark(timed(full))
