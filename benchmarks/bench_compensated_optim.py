"""One optimizer step over a transformer block's weights: CompensatedAdamW and
CompensatedSGD on bfloat16 weights (compiled and eager; state in bfloat16 and in
float32) against torch.optim on the same
bfloat16 weights (whose small updates round away) and on float32 weights, interleaved.

    python benchmarks/bench_compensated_optim.py [--device cuda] [--rounds N] [--no-save]

Rows go to results/compensated_optim.csv, the table to results/compensated_optim_<device>.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Cases, Sweep, main

from dtp_kernels.pipeline.compensated_optim import CompensatedAdamW, CompensatedSGD

# a Llama-7B block's weights at a quarter of the width: 4 attention projections and the
# MLP's 3, with the block's 2 norms
WIDTH, MLP = 1024, 2752
SHAPES = [(WIDTH, WIDTH)] * 4 + [(MLP, WIDTH), (MLP, WIDTH), (WIDTH, MLP), (WIDTH,), (WIDTH,)]


def setup(point: dict, device: torch.device) -> Cases:
    kind = point["optimizer"]
    settings = {"lr": 1e-4, "weight_decay": 0.01}
    if kind == "sgd":
        settings["momentum"] = 0.9

    def stepper(make, dtype: torch.dtype, **extra):
        params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype)) for s in SHAPES]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = make(params, **settings, **extra)
        optimizer.step()  # the state made (and the kernel compiled) before timing
        return optimizer.step

    ours = CompensatedAdamW if kind == "adamw" else CompensatedSGD
    theirs = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    return {
        ("torch bf16", kind): (stepper(theirs, torch.bfloat16), 3),
        ("torch fp32", kind): (stepper(theirs, torch.float32), 3),
        ("compensated bf16", kind): (stepper(ours, torch.bfloat16), 3),
        ("compensated bf16, fp32 state", kind): (
            stepper(ours, torch.bfloat16, state_dtype=torch.float32),
            3,
        ),
        ("compensated bf16 eager", kind): (stepper(ours, torch.bfloat16, fused=False), 3),
    }


SWEEP = Sweep(
    op="compensated_optim",
    title="Optimizer step, 9 weights of a Llama block at width 1024 (13.7M weights)",
    points=[
        {"shape": f"{len(SHAPES)} weights", "dtype": "bfloat16", "optimizer": kind}
        for kind in ("adamw", "sgd")
    ],
    setup=setup,
    baselines=["torch bf16", "torch fp32"],
    note=(
        "mode: the optimizer (SGD with momentum 0.9). x vs a baseline > 1: faster than it. "
        "torch bf16 loses every update below half a weight's spacing; compensated keeps "
        "them (tests/pipeline/test_compensated_optim.py). compensated bf16 holds its "
        "moments or momentum in bfloat16, as torch does; fp32 state holds them in float32 "
        "(`dtp prune`'s default, model.optimizer_state_dtype)."
    ),
)


if __name__ == "__main__":
    main(SWEEP, "compensated_optim", __doc__.splitlines()[0], rounds=15)
