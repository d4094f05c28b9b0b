"""No host synchronisation in a DTP training step (issue 7), the half that runs on CPU.

On a GPU the host waits for the device whenever it reads a device value: .item(),
.tolist(), .cpu(), .numpy(), bool()/float()/int() of a tensor, or .to() a CPU device.
These tests count exactly those calls, through patched Tensor methods, over steady-state
DTP training steps on CPU tensors, which run the same Python code as on a GPU.
On a GPU the tests marked cuda check the same steps with
torch.cuda.set_sync_debug_mode("error") and inside a captured CUDA graph.
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter

import pytest
import torch

from dtp_kernels import DTPPruner
from dtp_kernels.models import resnet20
from dtp_kernels.pipeline.step import training_step
from dtp_kernels.pipeline.train import make_optimizer
from utils import CUDA, cuda_backends

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


def dtp_training_setup(
    backend: str,
    mask_at: str = "parameters",
    budget: str = "layer",
    channels_last: bool = False,
    device: torch.device = CUDA,
    batch: int = 16,
):
    """resnet20 with DTP masks on `device`, its optimizer (state committed after each
    step) and one batch."""
    torch.manual_seed(0)
    model = resnet20().to(device)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, 32, 32, generator=gen).to(device)
    labels = torch.randint(0, 10, (batch,), generator=gen).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        images = images.to(memory_format=torch.channels_last)
    epilogue = backend if backend in ("cuda", "triton", "torch") else "auto"
    pruner = DTPPruner(
        model,
        images[:1],
        0.5,
        budget=budget,
        mask_at=mask_at,
        backend=backend,
        epilogue_backend=epilogue,
    )
    optimizer = make_optimizer(model, {"lr": 0.05}, pruner)
    pruner.attach(optimizer)
    return model, pruner, optimizer, images, labels


@pytest.mark.parametrize("budget", ["layer", "global", "flops"])
@pytest.mark.parametrize("mask_at", ["parameters", "activation"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_dtp_training_step_reads_nothing_back(budget, mask_at, backend):
    model, pruner, optimizer, images, labels = dtp_training_setup(
        backend, mask_at, budget, device=torch.device("cpu"), batch=4
    )
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


def clipped_accumulated_setup(device: torch.device):
    """A DTP ResNet-20 and a function running one optimizer step of two batches,
    clipped, on it; the pruner and that function."""
    backend = "cpu" if device.type == "cpu" else "auto"  # the CPU kernels take CPU tensors only
    model, pruner, optimizer, images, labels = dtp_training_setup(backend, device=device, batch=4)
    clip = (list(model.parameters()), 0.5)

    def step() -> None:
        for weight, first, last in [(0.5, True, False), (0.5, False, True)]:
            training_step(
                model,
                optimizer,
                images,
                labels,
                pruner,
                weight=weight,
                first=first,
                last=last,
                clip=clip,
            )

    return pruner, step


def test_clipped_and_accumulated_steps_read_nothing_back():
    """Gradient clipping (on the device) and the batches of an accumulated step. The
    clip moves its coefficient to each gradient's device: `to(cpu)` here, a no-op on
    CPU tensors (test_clipped_steps_do_not_sync_on_cuda checks the CUDA step)."""
    pruner, step = clipped_accumulated_setup(torch.device("cpu"))
    step()  # warm-up: per-state caches
    with count_host_reads() as counts:
        step()
        step()
    del counts["to(cpu)"]
    assert counts == Counter(), f"host reads in a clipped, accumulated step: {dict(counts)}"
    assert int(pruner.state.steps) == 3


def _accumulator(parameter: torch.Tensor):
    """The parameter's gradient accumulator: the live one if any node still holds it."""
    return parameter.view_as(parameter).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("export", [False, True], ids=["construct", "export"])
def test_no_traced_autograd_graph_outlives_the_pruner_calls(export):
    """Torch-Pruning's traced graph keeps autograd nodes (the parameters' AccumulateGrad
    among them) in reference cycles; they must be freed before the constructor or export
    returns, not left to the garbage collector: alive, they break the CUDA-graph capture
    of a later training step (test_training_step_in_cuda_graph_matches_eager). Every
    accumulator a forward with gradients made is marked; none may be found afterwards."""

    def mark(module, _inputs, _output):
        if torch.is_grad_enabled():
            for parameter in module.parameters():
                _accumulator(parameter).metadata["traced"] = True

    gc.collect()
    gc.disable()  # nothing but reference counting may free them
    try:
        model = resnet20()
        model.register_forward_hook(mark)  # deep copies (export's) keep it
        pruner = DTPPruner(model, torch.randn(1, 3, 32, 32), 0.5)
        checked = pruner.export() if export else model
        left = [
            name
            for name, parameter in checked.named_parameters()
            if _accumulator(parameter).metadata.get("traced")
        ]
    finally:
        gc.enable()
    assert not left


# -- on CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["layer", "flops"])
@pytest.mark.parametrize("mask_at", ["parameters", "activation"])
@pytest.mark.parametrize("backend", [*cuda_backends(), "torch"])
@pytest.mark.cuda
def test_training_step_has_no_host_sync_on_cuda(backend, mask_at, budget):
    from dtp_kernels.pipeline.step import training_step

    model, pruner, optimizer, images, labels = dtp_training_setup(backend, mask_at, budget)
    target = 0.5 if budget == "flops" else None
    for _ in range(2):  # warm-up: per-state caches, Triton compilation
        training_step(model, optimizer, images, labels, pruner, target)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            training_step(model, optimizer, images, labels, pruner, target)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(pruner.state.steps) == 4


@pytest.mark.cuda
def test_clipped_steps_do_not_sync_on_cuda():
    pruner, step = clipped_accumulated_setup(CUDA)
    step()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(pruner.state.steps) == 3


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-channels-last"])
@pytest.mark.parametrize("backend", cuda_backends())
@pytest.mark.cuda
def test_training_step_in_cuda_graph_matches_eager(backend, amp, monkeypatch):
    """A whole DTP training step (forward, backward, SGD step, state commit) captured in a
    CUDA graph and replayed gives what the same steps give eagerly; also under bf16
    autocast with channels_last (the GPU benchmark's setting)."""
    from dtp_kernels.pipeline.step import training_step

    runs = {}
    # restored after the test: the worker's later tests run with torch's defaults
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    for mode in ("eager", "graph"):
        model, pruner, optimizer, images, labels = dtp_training_setup(
            backend, channels_last=amp is not None
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
            for _ in range(3):
                training_step(model, optimizer, images, labels, pruner, amp=amp)
        torch.cuda.current_stream().wait_stream(side)
        if mode == "graph":
            graph = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                training_step(model, optimizer, images, labels, pruner, amp=amp)
            for _ in range(5):
                graph.replay()
        else:
            for _ in range(5):
                training_step(model, optimizer, images, labels, pruner, amp=amp)
        torch.cuda.synchronize()
        runs[mode] = (
            pruner.scores.detach().clone(),
            pruner.state.log_odds.clone(),
            pruner.state.shift.clone(),
            pruner.state.steps.clone(),
            torch.cat([p.detach().flatten() for p in model.parameters()]),
        )
    for a, b in zip(runs["eager"], runs["graph"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert int(runs["graph"][3]) == 8
