"""Forward and forward + backward of the DTP mask step for all 32 prunable groups of
torchvision's ResNet-50 (conv1 and conv2 of every bottleneck, ratio 0.6), per backend,
measured interleaved in one run; ratios against "reference" and "torch".

    python benchmarks/bench_transport.py [--device cpu|cuda] [--rounds 30] [--no-save]

On CUDA the providers are every backend present and torch.compile of the eager closed
form; on CPU reference, torch and cpu (C++). Rows go to results/transport.csv, the table
to results/transport_<device>.md, the plot to results/transport_<device>.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Cases, Sweep, run_sweep

import dtp_kernels
from dtp_kernels.benchmarking import RESNET50_GROUPS, mask_step

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
    points=[
        dict(
            shape=f"resnet50 {len(RESNET50_GROUPS)} groups, {sum(RESNET50_GROUPS)} channels",
            dtype="float32",
            sizes=RESNET50_GROUPS,
        )
    ],
    setup=setup,
    baselines=["reference", "torch"],
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    run_sweep(SWEEP, torch.device(args.device), args.rounds, not args.no_save, "transport")


if __name__ == "__main__":
    main()
