"""The mask step with N:M segments: forward + backward of DTP's transport step over
`numel` weights cut into blocks of 4 keeping 2 (one segment per block, as
granularity="n:m" runs it) on the kernels for tiny equal segments and on the general
kernels, against the same weights as one segment, interleaved; on GPUs also on the Triton
kernels, and at 1e8 weights.

    python benchmarks/bench_nm_step.py [--device cpu|cuda] [--rounds N] [--no-save]
        [--keep-freed-memory] [--no-output-cache]

Rows go to results/nm_step.csv, the table to results/nm_step_<device>.md. The ratio is
the cost of many tiny segments against one segment of the same size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Cases, Sweep, main

import dtp_kernels
from dtp_kernels import TransportState, transport_mask


def step(
    sizes: list[int],
    keep: float,
    device: torch.device,
    backend: str,
    tiny: bool = True,
    huge_pages: bool = True,
):
    """One fwd + bwd of the mask step over segments of `sizes`, keeping `keep` of each;
    `tiny=False` runs equal tiny segments on the general kernels (read from offsets),
    `huge_pages=False` without the CPU kernels' huge-page advice for their outputs."""
    numel = sum(sizes)
    state = TransportState(sizes, device=device)
    if not tiny:
        state.segment_size = 0
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(numel, generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(numel, generator=gen).to(device)
    if len(set(sizes)) == 1:  # one count for every segment, as DTPPruner passes N:M's
        kept = torch.tensor([keep * sizes[0]], device=device).expand(len(sizes))
    else:
        kept = torch.tensor([keep * n for n in sizes], device=device)

    def run() -> None:
        previous = dtp_kernels.set_cpu_huge_pages(huge_pages)
        transport_mask(scores, kept, state, backend=backend).backward(grad)
        scores.grad = None
        dtp_kernels.set_cpu_huge_pages(previous)

    return run


def op_step(numel: int, device: torch.device, shared: bool):
    """The 2:4 fwd + bwd of the compiled kernels through the op itself (dtp::transport_mask,
    no pending-state write), keep and eps shared by all blocks (stride-0 views, as
    transport_mask and DTPPruner pass them) or given per block (what they passed before:
    3 more bytes read per weight each way)."""
    nseg = numel // 4
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(numel, generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(numel, generator=gen).to(device)
    offsets = torch.arange(nseg + 1, device=device) * 4
    log_odds = torch.zeros(numel, device=device)
    shift = torch.zeros(nseg, device=device)
    keep = torch.tensor([2.0], device=device).expand(nseg)
    eps = torch.tensor([1.0], dtype=torch.float64, device=device).expand(nseg)
    if not shared:
        keep, eps = keep.contiguous(), eps.contiguous()

    def run() -> None:
        mask = torch.ops.dtp.transport_mask(
            scores, offsets, keep, eps, log_odds, shift, 1, True, 0, 4
        )
        mask[0].backward(grad)
        scores.grad = None

    return run


# Bytes per weight a fwd + bwd step must move: the forward reads scores and log-odds and
# writes the mask and next log-odds, the pending-state write reads and writes those
# log-odds again, the backward reads the mask gradient, scores and log-odds and writes
# the score gradient: 10 float32 accesses.
STEP_FLOATS = 10


def copy_of_step_bytes(numel: int, device: torch.device):
    """A copy moving the bytes of one step (half read, half written): its time over a
    step's is the fraction of copy bandwidth the step reaches."""
    src = torch.rand(numel * STEP_FLOATS // 2, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def setup(point: dict, device: torch.device) -> Cases:
    numel = point["numel"]
    backend = dtp_kernels.available_backends(device)[-1]
    blocks = [4] * (numel // 4)
    cases = {
        ("copy of the step's bytes", "full"): (copy_of_step_bytes(numel, device), 3),
        ("one segment", "full"): (step([numel], 0.5, device, backend), 3),
        ("2:4, tiny-segment kernels", "full"): (step(blocks, 0.5, device, backend), 3),
        ("2:4, general kernels", "full"): (step(blocks, 0.5, device, backend, tiny=False), 3),
    }
    if backend in ("cpu", "cuda"):  # the op alone: keep and eps shared or per segment
        cases[("2:4 op, keep and eps shared", "full")] = (op_step(numel, device, True), 3)
        cases[("2:4 op, keep and eps per segment", "full")] = (op_step(numel, device, False), 3)
    if device.type == "cpu":  # the same steps on 4 KiB pages (set_cpu_huge_pages(False))
        cases[("one segment, 4 KiB pages", "full")] = (
            step([numel], 0.5, device, backend, huge_pages=False),
            3,
        )
        cases[("2:4, tiny-segment kernels, 4 KiB pages", "full")] = (
            step(blocks, 0.5, device, backend, huge_pages=False),
            3,
        )
    if (
        device.type == "cuda"
        and backend != "triton"
        and "triton" in dtp_kernels.available_backends(device)
    ):
        # the same steps on the Triton kernels (split schedule for the one segment)
        cases[("one segment, triton", "full")] = (step([numel], 0.5, device, "triton"), 3)
        cases[("2:4, triton tile kernel", "full")] = (step(blocks, 0.5, device, "triton"), 3)
    return cases


SWEEP = Sweep(
    op="transport_mask_nm",
    title="transport_mask fwd + bwd: 2:4 segments against one segment of the same size",
    points=[
        {"shape": f"{n} weights", "dtype": "float32", "numel": n}
        for n in (2**16, 2**20, 10_000_000)
    ]
    + [{"shape": "100000000 weights", "dtype": "float32", "numel": 10**8, "devices": ("cuda",)}],
    setup=setup,
    baselines=["one segment", "copy of the step's bytes"],
    note="`auto` backend unless a row names triton; 1e8 weights on GPUs only. The 2:4 "
    "step's cost in one-segment steps is 1 / (x vs one segment); x vs copy is the "
    "fraction of copy bandwidth a step reaches (40 bytes per weight moved).",
)


if __name__ == "__main__":
    main(SWEEP, "nm_step", __doc__.splitlines()[0], rounds=5)
