"""FSDP2 in the pipeline (`run.sharding: fsdp`): the model's parameters, gradients and
optimizer state sharded over the ranks instead of copied to each (DDP).

The pruner is made on the whole model first (after a sharded pre-training, its weights
are gathered into the model built again: `model_state`), then `shard` applies
``fully_shard`` to each unit (a Hugging Face model's blocks, or the modules
`run.shard_units` names) and to the root, and the stage's optimizer is made on the
sharded parameters. The pruner's
own parameters (scores, learned ratios) stay whole on every rank and are averaged over
the ranks as under DDP. Checkpoints hold whole tensors, as an unsharded run's do
(gathered one tensor at a time on every rank, written by rank 0); `load_model_state`
and `load_optimizer_state` cut them into this rank's shards again.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from .errors import UsageError

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    FSDP_MODULES: tuple[type, ...] = (FSDPModule,)
except ImportError:  # torch without torch.distributed: nothing is sharded (and the
    FSDP_MODULES = ()  # functions below that take shards are never called)


def units(model: nn.Module, patterns: list[str]) -> list[nn.Module]:
    """The modules sharded as units of their own: those `patterns` (fnmatch globs over
    module names) name, or, with no patterns, a Hugging Face model's blocks (the classes
    its `_no_split_modules` lists)."""
    named = [(name, module) for name, module in model.named_modules() if name]
    if patterns:
        chosen: dict[str, nn.Module] = {}
        for pattern in patterns:
            hits = {n: m for n, m in named if fnmatch.fnmatchcase(n, pattern)}
            if not hits:
                examples = [n for n, _ in named[:8]]
                raise UsageError(
                    f"run.shard_units names {pattern!r}, which matches no module of the "
                    f"model; modules include {examples}"
                )
            chosen.update(hits)
        found = list(chosen.items())
    else:
        classes = set(getattr(model, "_no_split_modules", None) or ())
        found = [(n, m) for n, m in named if type(m).__name__ in classes]
        if not found:
            raise UsageError(
                f"run.sharding = 'fsdp' needs run.shard_units for {type(model).__name__}: "
                "globs naming the blocks to shard one by one (such as 'layer*.*'); a "
                "Hugging Face model's blocks are found by themselves"
            )
    names = [name for name, _ in found]
    nested = [n for n in names if any(n.startswith(o + ".") for o in names)]
    if nested:
        raise UsageError(
            f"run.shard_units: {nested[0]!r} lies inside another unit; name modules "
            "that do not contain each other"
        )
    return [module for _, module in found]


def shard(model: nn.Module, patterns: list[str]) -> None:
    """``fully_shard`` each unit of `model` (see `units`), then the model itself (the
    parameters no unit holds), in place, on the default process group's ranks."""
    for unit in units(model, patterns):
        fully_shard(unit)
    fully_shard(model)


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard` (FSDP2's fully_shard) has been applied to `model`."""
    return isinstance(model, FSDP_MODULES)


def reshard(model: nn.Module) -> None:
    """The sharded `model`'s parameters back to their shards (FSDP's root keeps its
    weights gathered after a forward that no backward follows)."""
    cast("FSDPModule", model).reshard()


@contextlib.contextmanager
def gradient_sync(model: nn.Module, on: bool) -> Iterator[None]:
    """A micro-batch of the sharded `model` that is not the optimizer step's last keeps
    its gradients local (FSDP's reduce-scatter waits for the last), as DDP's no_sync
    does."""
    fsdp = cast("FSDPModule", model)
    fsdp.set_requires_gradient_sync(on)
    try:
        yield
    finally:
        fsdp.set_requires_gradient_sync(True)


def whole(tensor: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
    """`tensor` whole on the CPU: a DTensor gathered from every rank (a collective: every
    rank calls it, in the same order), a plain tensor copied. With `keep` False the
    gathered tensor is dropped at once (a rank that only helps gather) and None comes
    back: no rank but the one that writes holds a whole copy."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu() if keep else None


def model_state(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's state_dict with whole tensors (see `whole`; {} without `keep`)."""
    state = {}
    for key, value in model.state_dict().items():
        tensor = whole(value, keep)
        if tensor is not None:
            state[key] = tensor
    return state


def optimizer_state(optimizer: torch.optim.Optimizer, keep: bool = True) -> dict:
    """The optimizer's state_dict with whole tensors, as an unsharded run's (see
    `whole`; {} without `keep`)."""
    state = optimizer.state_dict()
    state["state"] = {
        index: {
            key: whole(v, keep) if isinstance(v, torch.Tensor) else v for key, v in entry.items()
        }
        for index, entry in sorted(state["state"].items())
    }
    return state if keep else {}


def _like(value: torch.Tensor, reference: DTensor) -> DTensor:
    """The whole tensor `value` cut as `reference` (a DTensor) is, on its device."""
    value = value.to(reference.device_mesh.device_type)
    return distribute_tensor(value, reference.device_mesh, reference.placements)


def load_model_state(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Load whole tensors (`model_state`'s) into the sharded `model`."""
    current = model.state_dict()
    model.load_state_dict(
        {
            key: _like(value, current[key]) if isinstance(current.get(key), DTensor) else value
            for key, value in saved.items()
        }
    )


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load whole tensors (`optimizer_state`'s) into the optimizer of a sharded model:
    a state tensor of a sharded parameter's shape is cut as that parameter is."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in sorted(saved["state"].items()):
        param = params[int(index)]
        state[index] = {
            key: _like(v, param)
            if isinstance(param, DTensor) and isinstance(v, torch.Tensor) and v.shape == param.shape
            else v
            for key, v in entry.items()
        }
    optimizer.load_state_dict({**saved, "state": state})


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone while the block runs, when none is running
    (FSDP needs one; a single process shards over itself), else nothing."""
    if not dist.is_available():
        raise UsageError("run.sharding = 'fsdp' needs torch.distributed, which this torch lacks")
    if dist.is_initialized():
        yield
        return
    store = dist.HashStore()
    if device.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
