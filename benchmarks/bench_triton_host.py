"""The triton backend's host work per mask step with its kernels left out: forward +
backward of the step over ResNet-50's 32 groups, every kernel launch replaced by a no-op,
through the eager autograd Function that `transport_mask` uses (`triton`) against the
custom op that torch.compile traces followed by write_pending (`triton, through the
custom op`, how eager calls ran before), and one elementwise op with its backward
(`floor`), interleaved. What is left is Python, autograd and allocation: the part of the
step a GPU's host pays on top of Triton's launcher, measurable on any machine (the
triton backend exists on a CPU under TRITON_INTERPRET=1, set here).

    python benchmarks/bench_triton_host.py [--rounds N] [--no-save]

Rows go to results/triton_host.csv, the table to results/triton_host_cpu.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before dtp_kernels decides which backends exist

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESNET50_POINT, Cases, Sweep, main
from bench_host_cost import floor_step, triton_op_step

from dtp_kernels.benchmarking import mask_step
from dtp_kernels.kernels import transport_mask_triton


class _NoLaunch:
    """kernel[grid](...) that launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def leave_out_launches() -> None:
    """Make every launch of the triton backend's host functions a no-op; they still
    allocate the outputs and pick the schedule. For this process only."""
    for name in ("transport_mask_forward", "transport_mask_backward"):
        host_function = getattr(transport_mask_triton, name)

        def run(launch, *args, _host=host_function, **kwargs):
            return _host(lambda kernel: _NoLaunch(), *args, **kwargs)

        setattr(transport_mask_triton, name, run)


def setup(point: dict, device: torch.device) -> Cases:
    sizes = point["sizes"]
    return {
        ("floor", "full"): (floor_step(sum(sizes), device), 50),
        ("triton", "full"): (mask_step("triton", sizes, device, 0.6), 50),
        ("triton, through the custom op", "full"): (triton_op_step(sizes, device), 50),
    }


SWEEP = Sweep(
    op="transport_mask_triton_host",
    title="triton mask step fwd + bwd, kernel launches left out: eager Function against "
    "the custom op",
    points=[RESNET50_POINT],
    setup=setup,
    baselines=["floor", "triton, through the custom op"],
    note="Every Triton launch is a no-op: the rows are the host work around the kernels.",
)


if __name__ == "__main__":
    leave_out_launches()
    main(SWEEP, "triton_host", __doc__.splitlines()[0], rounds=30)
