"""No host synchronisation in a DTP training step (issue 7), the half that runs on CPU.

On a GPU the host waits for the device whenever it reads a device value: .item(),
.tolist(), .cpu(), .numpy(), bool()/float()/int() of a tensor, or .to() a CPU device.
These tests count exactly those calls, through patched Tensor methods, over steady-state
DTP training steps on CPU tensors, which run the same Python code as on a GPU.
tests/test_gpu.py checks the same steps with torch.cuda.set_sync_debug_mode("error") and
a CUDA graph.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from dtp_kernels import DTPPruner
from dtp_kernels.models import resnet20
from dtp_kernels.pipeline.step import training_step
from dtp_kernels.pipeline.train import make_optimizer

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """Count calls of every Tensor method that reads a value back to the host."""
    counts: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in (*HOST_READS, "to")}

    def counting(name, original):
        def method(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return method

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            counts["to(cpu)"] += 1
        return saved["to"](self, *args, **kwargs)

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name, saved[name]))
        torch.Tensor.to = to
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def test_the_counter_sees_host_reads():
    x = torch.ones(3)
    with count_host_reads() as counts:
        x.sum().item()
        float(x[0])
        bool(x.any())
        x.tolist()
        x.to("cpu")
    assert counts == Counter(item=1, __float__=1, __bool__=1, tolist=1, **{"to(cpu)": 1})
    assert torch.Tensor.item is torch._C.TensorBase.item  # restored


@pytest.mark.parametrize("budget", ["layer", "global", "flops"])
@pytest.mark.parametrize("mask_at", ["parameters", "activation"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_dtp_training_step_reads_nothing_back(budget, mask_at, backend):
    torch.manual_seed(0)
    model = resnet20()
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    pruner = DTPPruner(
        model,
        images[:1],
        0.5,
        budget=budget,
        mask_at=mask_at,
        backend=backend,
        epilogue_backend=backend,
    )
    optimizer = make_optimizer(model, {"lr": 0.05}, pruner)
    pruner.attach(optimizer)
    target = 0.5 if budget == "flops" else None
    for _ in range(2):  # first steps fill the per-state caches (checked keep, eps, sizes)
        training_step(model, optimizer, images, labels, pruner, target)
    steps_before = int(pruner.state.steps)
    with count_host_reads() as counts:
        for _ in range(2):
            loss = training_step(model, optimizer, images, labels, pruner, target)
    assert counts == Counter(), f"host reads in a DTP training step: {dict(counts)}"
    assert int(pruner.state.steps) == steps_before + 2  # the state did advance
    assert torch.isfinite(loss)
