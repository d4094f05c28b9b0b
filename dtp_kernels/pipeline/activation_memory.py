"""The activation memory of one training batch, measured without memory or compute.

The training forward (the model, the pruner's masks, the loss) runs on fake tensors
(torch's FakeTensorMode: shapes and dtypes, no data), and every tensor it keeps for the
backward pass is recorded through autograd's saved-tensor hooks, once per storage (a
view of a saved tensor costs nothing more), the parameters and buffers left out (the
model holds them whatever the batch; the plan counts them with the training state).
Under activation checkpointing (transformers' layers, as ``run.activation_checkpointing``
sets them) a checkpointed layer keeps only its inputs and recomputes the rest during the
backward pass, one layer at a time, so the figure is what is saved outside those
layers, plus their inputs, plus the largest one layer saves.

What this does not count: the backward pass's own temporaries (the gradient of the
activations of the layer being differentiated) and the allocator's rounding. Under
``run.amp`` the CPU's autocast rules stand in for the GPU's (the same operations run in
lower precision for the common layers: linear, convolution, matmul). A transformers
model takes its traced path on fake tensors: it builds the causal mask as a tensor and
repeats grouped key/value heads, where its eager run lets the attention kernel do both,
so its figure is somewhat above the run's (17% for the tests' small Llama, whose
sequence is long for its width; less for wide models).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks

from .step import forward_loss

if TYPE_CHECKING:
    from transformers.modeling_layers import GradientCheckpointingLayer


def _checkpointed(model: nn.Module) -> list[GradientCheckpointingLayer]:
    """The layers of `model` that transformers' activation checkpointing recomputes."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


@contextlib.contextmanager
def _whole(layers: list[GradientCheckpointingLayer]) -> Iterator[None]:
    """The checkpointed `layers` run whole inside the block (their saved tensors seen)."""
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


def saved_activation_bytes(
    model: nn.Module,
    inputs: tuple[tuple[int, ...], torch.dtype],
    labels: tuple[tuple[int, ...], torch.dtype],
    amp: torch.dtype | None = None,
    outputs: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """Bytes the training forward of `model` keeps for the backward pass on one batch of
    `inputs` (shape, dtype) against `labels` (shape, dtype), under autocast with `amp`;
    `outputs` gives the logits (RunOptions.outputs), `prepare` puts the batch in the run's
    memory format. The model runs in training mode on fake tensors: nothing is allocated
    or computed, its parameters and buffers are left as they were, and a DTP pruner on
    it trains on as it would have (its next forward replaces this one's masks)."""
    layers = _checkpointed(model)
    current: list[nn.Module | None] = [None]
    saved: dict[nn.Module | None, dict[int, int]] = {}  # layer (None: outside) -> storages
    layer_inputs: dict[int, int] = {}
    held = []  # the layers' inputs, alive to the end: a freed storage's id can come back

    def enter(layer: nn.Module, args: tuple, kwargs: dict) -> None:
        current[0] = layer
        for value in [*args, *kwargs.values()]:
            if isinstance(value, torch.Tensor):
                held.append(value)
                storage = value.untyped_storage()
                layer_inputs[storage._cdata] = storage.nbytes()

    def leave(*_) -> None:
        current[0] = None

    handles = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in layers]
    handles += [m.register_forward_hook(leave) for m in layers]
    was_training = model.training
    # in-place updates of a real buffer by itself run for real (BatchNorm's batch count)
    buffers = [(b, b.clone()) for b in model.buffers()]
    model.train()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, _whole(layers):
            # an operation saves a parameter (or buffer) itself or its fake stand-in: both
            # are left out; the stand-ins are held so that their storages stay known
            real = [*model.parameters(), *model.buffers()]
            fakes = [mode.from_tensor(t) for t in real]
            known = {t.untyped_storage()._cdata for t in [*real, *fakes]}

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage._cdata not in known:
                    saved.setdefault(current[0], {})[storage._cdata] = storage.nbytes()
                return tensor

            batch = torch.empty(inputs[0], dtype=inputs[1])
            batch = prepare(batch) if prepare is not None else batch
            target = torch.empty(labels[0], dtype=labels[1])
            with saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = forward_loss(model, batch, target, amp, outputs)
            del loss
    finally:
        model.train(was_training)
        for buffer, value in buffers:
            buffer.copy_(value)
        for handle in handles:
            handle.remove()
    outside = saved.pop(None, {})
    if not layers:
        return sum(outside.values())
    kept = {**outside, **layer_inputs}
    largest = max(
        (sum(n for key, n in inside.items() if key not in kept) for inside in saved.values()),
        default=0,
    )
    return sum(kept.values()) + largest
