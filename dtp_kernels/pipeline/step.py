"""One training step with or without DTP masks: forward, loss, backward, optimizer step.

The pruner's forward pre-hook computes every mask in one `transport_mask` call and the
hook `pruner.attach(optimizer)` installs commits the transport state after the optimizer
step, so the same function serves the dense and the masked model. Nothing in it reads a
device value back to the host (tests/reliability/test_no_host_sync.py, on the CPU and on CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from ..pruning.pruner import DTPPruner


def forward_loss(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    amp: torch.dtype | None = None,
    outputs: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A training step's forward: the cross-entropy of `outputs(model, images)` (default:
    model(images)) against `labels`, under torch.autocast with `amp` when given."""
    # No autocast weight cache: every weight is cast once per forward anyway, and cached
    # casts made during CUDA-graph capture must not outlive it (torch's CUDA-graph notes).
    autocast = (
        torch.autocast(images.device.type, dtype=amp, cache_enabled=False)
        if amp is not None
        else contextlib.nullcontext()
    )
    with autocast:
        logits = model(images) if outputs is None else outputs(model, images)
        # float32 logits: bfloat16 weights (model.dtype) give bfloat16 logits, whose
        # log-softmax would lose the loss's precision (autocast upcasts it alike)
        return nn.functional.cross_entropy(logits.float(), labels)


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    pruner: DTPPruner | None = None,
    flops_target: float | None = None,
    penalty_weight: float = 10.0,
    amp: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    outputs: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    *,
    weight: float = 1.0,
    first: bool = True,
    last: bool = True,
    clip: tuple[list[torch.Tensor], float] | None = None,
) -> torch.Tensor:
    """Run one step and return the loss, detached and left on the device.

    The loss is the cross-entropy of `outputs(model, images)` (default: model(images);
    RunOptions.outputs gives a causal language model's logits, classes in dim 1) against
    `labels`. flops_target adds `penalty_weight * pruner.penalty(flops_target)`
    (budget="flops"); amp runs the forward under torch.autocast with that dtype (bf16 or
    fp16); scaler (for fp16) scales the loss and skips the optimizer step, and so the
    transport-state commit, when a gradient is not finite.

    Under gradient accumulation a call is one micro-batch of an optimizer step: `first`
    clears the gradients, `last` runs the optimizer step (and with it the transport-state
    commit), and the loss's gradient is scaled by `weight`, the micro-batch's share of the
    step's samples. Every micro-batch's forward computes the same masks: the transport
    state only changes at the commit.

    clip = (parameters, max_norm) scales those parameters' gradients to a total norm of
    at most max_norm before the optimizer step (after unscaling them, under a scaler),
    on the device: no host read.
    """
    loss = forward_loss(model, images, labels, amp, outputs)
    if flops_target is not None:
        if pruner is None:
            raise ValueError("training_step: flops_target needs the pruner whose penalty it is")
        loss = loss + penalty_weight * pruner.penalty(flops_target)
    scaled = loss if weight == 1.0 else loss * weight
    if first:
        optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        scaled.backward()
        if last:
            if clip is not None:
                nn.utils.clip_grad_norm_(*clip)
            optimizer.step()
    else:
        scaler.scale(scaled).backward()
        if last:
            if clip is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(*clip)
            scaler.step(optimizer)
            scaler.update()
    return loss.detach()


def compile_model(model: nn.Module, **options) -> nn.Module:
    """``torch.compile`` as ``run.compile: true`` applies it: the default mode, with static
    shapes (``dynamic=False``). Under torch's default, automatic dynamic shapes, an epoch's
    last, smaller batch recompiles the model with a symbolic batch size, and Dynamo then
    runs that dynamic-shape graph for every later batch of every size; static shapes give
    the last batch a graph of its own (one more compilation) and keep every full batch on
    the graph specialised for it (tests/pipeline/test_pipeline.py). `options` go to
    torch.compile (a test's backend)."""
    return cast(nn.Module, torch.compile(model, dynamic=False, **options))
