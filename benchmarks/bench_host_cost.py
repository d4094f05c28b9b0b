"""The mask step's wall time against its floor: forward + backward of the DTP mask step
over ResNet-50's 32 groups (7,552 channels) per backend, against one elementwise op and
its backward on a tensor of the same size (`floor`), interleaved in one run. On a GPU,
and for groups this small on a CPU, the step is bound by host work (Python checks, the
dispatcher, autograd bookkeeping, allocations): the ratio to the floor is what is left
to remove.

    python benchmarks/bench_host_cost.py [--device cpu|cuda] [--rounds N] [--no-save]

Rows go to results/host_cost.csv, the table to results/host_cost_<device>.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESNET50_POINT, Cases, Sweep, main

import dtp_kernels
from dtp_kernels.benchmarking import mask_step


def floor_step(numel: int, device: torch.device):
    """One elementwise op and its backward on `numel` floats: the least a step can cost."""
    x = torch.randn(numel, device=device, requires_grad=True)
    grad = torch.randn(numel, device=device)

    def step() -> None:
        (x * 2.0).backward(grad)
        x.grad = None

    return step


def triton_op_step(sizes: list[int], device: torch.device, ratio: float = 0.6):
    """The triton step through its custom op (dtp::transport_mask_triton, the path
    torch.compile traces) and write_pending: how an eager `transport_mask` call ran it
    before its eager autograd Function; the same inputs as mask_step's."""
    import importlib

    from dtp_kernels import TransportState

    module = importlib.import_module("dtp_kernels.transport_mask")
    state = TransportState(sizes, device=device)
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(sum(sizes), generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(sum(sizes), generator=gen).to(device)
    keep = torch.tensor([n - math.ceil(ratio * n) for n in sizes], device=device)
    eps = torch.ones(len(sizes), dtype=torch.float64, device=device)

    def step() -> None:
        mask, new_d, new_shift, flags = module._transport_mask_triton(
            scores, keep, eps, state, 1, False
        )
        state.write_pending(new_d, new_shift, nonfinite=flags)
        mask.backward(grad)
        scores.grad = None

    return step


def setup(point: dict, device: torch.device) -> Cases:
    backends = [
        b
        for b in dtp_kernels.available_backends(device)
        if b != "reference" and not (device.type == "cpu" and b == "triton")
    ]
    cases = {("floor", "full"): (floor_step(sum(point["sizes"]), device), 50)}
    for backend in backends:
        cases[(backend, "full")] = (mask_step(backend, point["sizes"], device, 0.6), 50)
    if "triton" in backends:  # the eager Function's baseline, same run
        cases[("triton, through the custom op", "full")] = (
            triton_op_step(point["sizes"], device),
            50,
        )
    return cases


SWEEP = Sweep(
    op="transport_mask_host_cost",
    title="transport_mask fwd + bwd against one elementwise op and its backward",
    points=[RESNET50_POINT],
    setup=setup,
    baselines=["floor"],
    note="The step's cost in floors is 1 / (x vs floor).",
)


if __name__ == "__main__":
    main(SWEEP, "host_cost", __doc__.splitlines()[0], rounds=30)
