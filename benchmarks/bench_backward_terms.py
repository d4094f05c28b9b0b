"""The CPU backward of the mask step with its last pass's terms formed from the forward's
mask (p = mask / k, q = p (1 - S1 p): what the autograd node runs) against the same
backward recomputing them from the scores and log-odds (an exp and a division per
element), interleaved in one run: ResNet-50's 32 groups and one segment of 1e6 and 1e7
elements.

    python benchmarks/bench_backward_terms.py [--rounds N] [--no-save]

Rows go to results/backward_terms.csv, the table to results/backward_terms_cpu.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESNET50_POINT, Cases, Sweep, main

from dtp_kernels import TransportState
from dtp_kernels.transport_mask import _check_eps, _op_args


def setup(point: dict, device: torch.device) -> Cases:
    sizes = point["sizes"]
    state = TransportState(sizes, device=device)
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(sum(sizes), generator=gen).to(device)
    grad = torch.randn(sum(sizes), generator=gen).to(device)
    keep = torch.tensor([0.4 * n for n in sizes], device=device)
    args = _op_args(scores, keep, _check_eps(1.0, state), state, 1, False, 0)
    mask, _, _, stats, _ = torch.ops.dtp.transport_mask(*args)
    common = (grad, scores, args[1], keep, args[3], args[4], stats, False, 0, 0)
    calls = 50 if sum(sizes) < 100_000 else 2
    return {
        ("recompute", "bwd"): (lambda: torch.ops.dtp.transport_mask_backward(*common), calls),
        ("from mask", "bwd"): (lambda: torch.ops.dtp.transport_mask_backward(*common, mask), calls),
    }


def segment(numel: int) -> dict:
    return dict(shape=f"one segment of {numel:.0e}", dtype="float32", sizes=[numel])


SWEEP = Sweep(
    op="transport_mask_backward_terms",
    title="transport_mask backward: terms from the forward's mask against recomputed",
    points=[
        {**RESNET50_POINT, "devices": ("cpu",)},
        {**segment(10**6), "devices": ("cpu",)},
        {**segment(10**7), "devices": ("cpu",)},
    ],
    setup=setup,
    baselines=["recompute"],
    note="x vs recompute > 1: the backward from the mask is that many times faster.",
)


if __name__ == "__main__":
    main(SWEEP, "backward_terms", __doc__.splitlines()[0], rounds=20)
