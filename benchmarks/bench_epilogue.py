"""The masked-channel epilogue, out = relu((y + bias[c]) * mask[c]), per backend against a
plain copy of the same bytes (the memory limit), measured interleaved in one run.

    python benchmarks/bench_epilogue.py [--device cpu|cuda] [--rounds 10] [--no-save]

On CPU: C++ vs eager; on CUDA: the GPU kernels vs eager vs torch.compile of the eager
expression. Modes: fwd, bwd (backward only, producing dy, dmask and dbias), full (fwd +
bwd). Rows go to results/epilogue.csv, the table to results/epilogue_<device>.md, the
plot to results/epilogue_<device>.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Cases, Sweep, main

import dtp_kernels
from dtp_kernels import masked_channel_epilogue

SHAPE = (64, 256, 28, 28)


def setup(point: dict, device: torch.device) -> Cases:
    dtype = getattr(torch, point["dtype"])
    fmt = torch.channels_last if point["layout"] == "channels_last" else torch.contiguous_format
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype, memory_format=fmt)
    mask = torch.rand(SHAPE[1], generator=gen).to(device).requires_grad_(True)
    bias = torch.randn(SHAPE[1], generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype, memory_format=fmt)
    y.requires_grad_(True)
    # The memory limit of an out-of-place op: allocate the output, read y, write it.
    cases = {("copy", "fwd"): (lambda: y.detach().clone(), 1)}
    functions = {
        b: (lambda b=b: masked_channel_epilogue(y, mask, bias, "relu", backend=b))
        for b in epilogue_backends(device)
    }
    if device.type == "cuda":  # the eager epilogue compiled by inductor: the baseline to beat
        compiled = torch.compile(
            lambda y, mask, bias: masked_channel_epilogue(y, mask, bias, "relu", backend="torch")
        )
        functions["torch.compile"] = lambda: compiled(y, mask, bias)
    for provider, fwd in functions.items():
        graph_out = fwd()
        cases[(provider, "fwd")] = (fwd, 1)
        cases[(provider, "bwd")] = (
            lambda out=graph_out: torch.autograd.grad(
                out, (y, mask, bias), grad, retain_graph=True
            ),
            1,
        )
        cases[(provider, "full")] = (
            lambda f=fwd: torch.autograd.grad(f(), (y, mask, bias), grad),
            1,
        )
    return cases


def epilogue_backends(device: torch.device) -> list[str]:
    """The epilogue's backends that run on `device` (the interpreted Triton is no CPU path)."""
    return [
        b
        for b in dtp_kernels.available_backends(device)
        if b != "reference" and not (device.type == "cpu" and b == "triton")
    ]


SWEEP = Sweep(
    op="masked_channel_epilogue",
    title=f"masked_channel_epilogue (relu, with bias), {'x'.join(map(str, SHAPE))}",
    points=[
        dict(shape=f"{'x'.join(map(str, SHAPE))} {layout}", dtype=dtype, layout=layout)
        for layout, dtype in (
            ("nchw", "float32"),
            ("channels_last", "float32"),
            ("nchw", "bfloat16"),
        )
    ],
    setup=setup,
    baselines=["copy", "torch"],
    warmup=1,
    note="`x vs copy` below 1: slower than one out-of-place copy of y.",
)


if __name__ == "__main__":
    main(SWEEP, "epilogue", __doc__.splitlines()[0], rounds=10)
