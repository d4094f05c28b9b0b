"""One training step with or without DTP masks: forward, loss, backward, optimizer step.

The pruner's forward pre-hook computes every mask in one `transport_mask` call and the
hook `pruner.attach(optimizer)` installs commits the transport state after the optimizer
step, so the same function serves the dense and the masked model. Nothing in it reads a
device value back to the host (tests/reliability/test_no_host_sync.py, on the CPU and on CUDA).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    pruner: nn.Module | None = None,
    flops_target: float | None = None,
    penalty_weight: float = 10.0,
    amp: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """Run one step and return the loss, detached and left on the device.

    flops_target adds `penalty_weight * pruner.penalty(flops_target)` (budget="flops");
    amp runs the forward under torch.autocast with that dtype (bf16 or fp16); scaler (for
    fp16) scales the loss and skips the optimizer step, and so the transport-state
    commit, when a gradient is not finite.
    """
    # No autocast weight cache: every weight is cast once per forward anyway, and cached
    # casts made during CUDA-graph capture must not outlive it (torch's CUDA-graph notes).
    autocast = (
        torch.autocast(images.device.type, dtype=amp, cache_enabled=False)
        if amp is not None
        else contextlib.nullcontext()
    )
    with autocast:
        loss = nn.functional.cross_entropy(model(images), labels)
    if flops_target is not None:
        loss = loss + penalty_weight * pruner.penalty(flops_target)
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.detach()
