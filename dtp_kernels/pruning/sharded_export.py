"""Exporting a model FSDP2 shards (``fully_shard`` after the pruner was made) or
DeepSpeed's ZeRO stage 3 partitions (``deepspeed.initialize`` after it).

export() copies the model whole, which a sharded model cannot give: its parameters are
DTensor shards (and FSDP refuses a deep copy) or ZeRO-3's empty partitioned tensors.
Instead every rank gathers the weights, one tensor at a time, into the model built
again unsharded; a pruner made on that model as the first was, holding the first's
scores and transport state, exports it with every check export() makes. Only one
whole tensor at a time exists beside the shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from .base import is_sharded
from .checkpoint_keys import unmasked_keys
from .example_inputs import on_model_device

if TYPE_CHECKING:
    from .pruner import DTPPruner


def export_sharded(pruner: DTPPruner, unsharded: nn.Module | None) -> nn.Module | None:
    """The export of `pruner.model`, which FSDP2 shards or ZeRO-3 partitions, made from
    `unsharded`: the model
    built again as the pruner's model was (same class and config, any weights, not
    sharded, no pruner on it; on the device the export should be on). Every rank of the
    default process group calls it, as the weights are gathered collectively; a rank
    that passes None only takes part in the gathering and returns None (build the model
    on rank 0 alone to spare the others its memory). Buffers, which FSDP does not shard
    (BN statistics), are rank 0's on every rank, so every rank exports the same model.
    `unsharded` is left holding the gathered weights, without masks."""
    sharded = pruner.model
    renamed = unmasked_keys(sharded)
    state = {
        renamed.get(key, key): value
        for key, value in sharded.state_dict(keep_vars=True).items()
        if isinstance(value, torch.Tensor)  # not a module's extra state
    }
    shards = [value for value in state.values() if is_sharded(value)]
    if not shards:
        raise ValueError(
            "export_sharded() gathers a model FSDP2 shards or ZeRO-3 partitions, and no "
            f"parameter of {type(sharded).__name__} is: call export()"
        )
    if not dist.is_initialized():
        raise RuntimeError("export_sharded() needs the process group the model is sharded over")
    device = _communication_device(shards[0])  # where the process group's backend works
    problem = None if unsharded is None else _mismatch(state, unsharded)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)  # every rank raises, or none: no hang
    refused = [(rank, text) for rank, text in enumerate(problems) if text]
    if refused:
        rank, text = refused[0]
        raise ValueError(f"unsharded (rank {rank}'s): {text}")
    targets = None if unsharded is None else _tensors(unsharded)
    with torch.no_grad():
        for key, value in state.items():  # collectives, in the same order on every rank
            if is_sharded(value):
                whole = _gathered(value, device)
            else:  # rank 0's: every rank's export alike
                whole = value.detach().to(device, copy=True)
                dist.broadcast(whole, src=0)
            if targets is not None:
                targets[key].copy_(whole)
            del whole
    if unsharded is None:
        return None
    from .pruner import DTPPruner

    arguments = pruner.made_with()
    arguments["example_inputs"] = on_model_device(arguments["example_inputs"], unsharded)
    again = DTPPruner(unsharded, **arguments)
    try:
        refuse_other_groups(again, pruner)
        again.load_state_dict(pruner.state_dict())
        return again.export()
    finally:
        again.remove()


def refuse_other_groups(again: DTPPruner, pruner: DTPPruner) -> None:
    """ValueError unless `again`, made on the model built again, has `pruner`'s groups:
    names and sizes, in order (scores of other groups would load as long as their total
    is the same)."""
    built = [(g.name, size) for g, size in zip(again.groups, again.sizes, strict=True)]
    trained = [(g.name, size) for g, size in zip(pruner.groups, pruner.sizes, strict=True)]
    if built != trained:
        pairs = zip(built, trained, strict=False)  # where they part (or the shorter ends)
        first = next((i for i, (b, t) in enumerate(pairs) if b != t), len(built))
        raise ValueError(
            f"unsharded: a pruner made on it has the groups {built[first : first + 2]} where "
            f"the sharded model's pruner has {trained[first : first + 2]} ({len(built)} groups "
            f"against {len(trained)}): build it as the pruner's model was built"
        )


def _gathered(shard: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor of FSDP2's `shard` or of a parameter ZeRO-3 partitioned, on every
    rank (a collective)."""
    if hasattr(shard, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([shard]):
            return shard.data.detach().clone()
    from torch.distributed.tensor import DTensor

    moved = shard.to(device)  # (a CPU-offloaded shard moved first)
    if not isinstance(moved, DTensor):
        raise TypeError(f"a sharded parameter is a {type(shard).__name__}, not FSDP2's DTensor")
    return moved.full_tensor()


def _whole_shape(value: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor (a partitioned parameter's own is empty)."""
    partitioned = getattr(value, "ds_shape", None) if hasattr(value, "ds_id") else None
    return tuple(value.shape if partitioned is None else partitioned)


def _mismatch(state: dict[str, torch.Tensor], unsharded: nn.Module) -> str | None:
    """What keeps `unsharded` from taking the gathered `state`: sharded, on the meta
    device, carrying masks, other keys, shapes or dtypes. None where it takes it."""
    mine = _tensors(unsharded)
    if any(is_sharded(value) for value in mine.values()):
        return "its parameters are sharded: build it again and do not shard it"
    if any(value.is_meta for value in mine.values()):
        return "its tensors are on the meta device: build it where the weights can be copied"
    masked = [n for n, m in unsharded.named_modules() if parametrize.is_parametrized(m)]
    if masked:
        return f"{masked[0]!r} carries parametrizations (a pruner's masks?): build it again"
    missing = [key for key in state if key not in mine]
    unexpected = [key for key in mine if key not in state]
    if missing or unexpected:
        return (
            f"its state_dict keys differ from the sharded model's: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for key, value in state.items():
        if tuple(mine[key].shape) != _whole_shape(value) or mine[key].dtype != value.dtype:
            return (
                f"{key!r} is {tuple(mine[key].shape)} {mine[key].dtype}; the sharded "
                f"model's is {_whole_shape(value)} {value.dtype}"
            )
    return None


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state-dict tensors themselves (parameters and buffers), by key."""
    state = model.state_dict(keep_vars=True)
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def _communication_device(shard: torch.Tensor) -> torch.device:
    """The device the process group communicates on (the GPU this rank uses under NCCL):
    a DTensor's mesh's, which under FSDP2's CPU offload is not its shard's; gloo's CPU
    or the current accelerator under ZeRO-3."""
    if hasattr(shard, "device_mesh"):
        kind = shard.device_mesh.device_type
    else:
        accelerator = torch.accelerator.current_accelerator()
        kind = "cpu" if dist.get_backend() == "gloo" or accelerator is None else accelerator.type
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)  # torch.cuda, torch.xpu, ...
    return torch.device(kind, module.current_device())
