"""Forward and forward + backward of the DTP mask step for all 32 prunable groups of
torchvision's ResNet-50 (conv1 and conv2 of every bottleneck, ratio 0.6), per backend,
measured interleaved in one run; ratios against "reference" and "torch".

    python benchmarks/bench_transport.py [--device cpu|cuda] [--rounds 30] [--no-save]

On CUDA the providers are every backend present and torch.compile of the eager closed
form; on CPU reference, torch and cpu (C++). Rows go to results/transport.csv, the table
to results/transport_<device>.md, the plot to results/transport_<device>.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESNET50_POINT, Cases, Sweep, main

import dtp_kernels
from dtp_kernels.benchmarking import mask_step

RATIO = 0.6


def setup(point: dict, device: torch.device) -> Cases:
    backends = [
        b
        for b in dtp_kernels.available_backends(device)
        if not (device.type == "cpu" and b == "triton")
    ]
    if device.type == "cuda":  # the eager closed form compiled: the baseline to beat on GPU
        backends.append("torch.compile")
    cases = {}
    for mode, backward in (("fwd", False), ("full", True)):
        for backend in backends:
            compiled = backend == "torch.compile"
            step = mask_step(
                "torch" if compiled else backend,
                point["sizes"],
                device,
                RATIO,
                backward=backward,
                compiled=compiled,
            )
            cases[(backend, mode)] = (step, 2 if backend == "reference" else 50)
    return cases


SWEEP = Sweep(
    op="transport_mask",
    title="transport_mask, ResNet-50's 32 groups (ratio 0.6)",
    points=[RESNET50_POINT],
    setup=setup,
    baselines=["reference", "torch"],
)


if __name__ == "__main__":
    main(SWEEP, "transport", __doc__.splitlines()[0], rounds=30)
