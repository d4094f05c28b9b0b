"""Modules that read a channel group from outside it, proven before its channels are
pruned.

Torch-Pruning's graph follows the channels through layers and tensor ops, not through
what a module's code does with the shape of its input. timm's LambdaLayer reshapes its
output to its input's channel count: cut the channels that feed it and the exported
model fails where the masked one runs, which export() would only find after training.

So a group's readers (the linear, conv and recurrent layers that lose input channels)
are proven inside the module
that holds them: the outermost module below the model that holds a reader and no other
layer of the group, and is no container (a Sequential's code uses no width, and would
run all it holds), when the example forward hands it the readers' input as it is. Run
on that input with a random half of the channels zeroed, and again cut to the kept
channels with its readers' input columns cut, it must compute the same (within the
proof's tolerance). A group whose module fails, or computes other values, is refused
by name. A module whose output changes shape when cut (it passes the channels on) is
left to export's check, as is one whose readers see a tensor it made itself (or a
packed sequence).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .channel_graph import output_tensors
from .cuts import channel_dim, cut_inputs
from .grouped_convs import is_grouped
from .groups import ChannelGroup
from .precision import ieee_fp32
from .proof import close, dropped, example_calls, random_half
from .recurrent_readers import RECURRENT

READERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, *RECURRENT)


# modules whose forward only hands their input to their children (or none): their own
# code uses no width, and proving one would run all it holds (a network's whole body)
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _enclosing(name: str, modules: dict[str, nn.Module], members: set[int]) -> str | None:
    """The outermost module above `name` (the model itself excluded) that holds no module
    of `members` and is no container, or None when there is none."""
    found = None
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:depth])
        if any(id(m) in members for m in modules[outer].modules()):
            break
        if not isinstance(modules[outer], CONTAINERS):
            found = outer
    return found


def _members(group: ChannelGroup) -> set[int]:
    """The ids of the group's modules other than its readers."""
    held = [
        group.layer,
        group.bn,
        group.rows,
        group.group_norm,
        *group.kept_out,
        *group.norms,
        *group.param_owners,
        *group.response_norms,
        *(norm for norm, _ in group.rms_norms),
        *(layer for pair in group.producers for layer in pair),
    ]
    return {id(m) for m in held if m is not None}


def _provable(group: ChannelGroup, reader: nn.Module) -> bool:
    """Whether `reader` reads the group's channels one to one, as its whole input."""
    return (
        isinstance(reader, READERS)
        and not is_grouped(reader)
        and reader not in group.reads
        and group.parts == 1
        and group.conv_groups == 1
    )


def _located(call: tuple[tuple, dict], x: torch.Tensor) -> list[tuple[int | str, torch.Tensor]]:
    """Where in `call` (a position or a keyword) the tensor `x` itself is passed."""
    args, kwargs = call
    places = [(i, a) for i, a in enumerate(args) if a is x]
    return places + [(k, v) for k, v in kwargs.items() if v is x]


def _with(call: tuple[tuple, dict], place: int | str, value: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = call
    if isinstance(place, int):
        return (*args[:place], value, *args[place + 1 :]), kwargs
    return args, {**kwargs, place: value}


def proof_failure(
    module: nn.Module,
    call: tuple[tuple, dict],
    place: int | str,
    dim: int,
    readers: list[nn.Module],
    group: ChannelGroup,
) -> str | None:
    """What goes wrong when `module`, called as in `call` with its input at `place` cut
    along `dim` to a random half of the group's units and the `readers` in it cut alike,
    runs against the same call with the other channels zeroed; None when it computes the
    same, or when the cut changes its outputs' shape (the channels pass on: export's
    check decides)."""
    args, kwargs = call
    x = args[place] if isinstance(place, int) else kwargs[place]
    keep = group.channels(random_half(group.size, torch.Generator().manual_seed(0)))
    keep = keep.to(x.device)
    zeroed = x.index_fill(dim, dropped(x.shape[dim], keep, x.device), 0)
    edited = copy.deepcopy(module)
    edited.eval()  # not chained: some modules' train() returns None
    names = {id(m): n for n, m in module.named_modules()}
    copies = dict(edited.named_modules())
    with torch.no_grad(), ieee_fp32():  # TF32 would round the two apart
        zeroed_args, zeroed_kwargs = _with(call, place, zeroed)
        try:
            want = output_tensors(edited(*zeroed_args, **zeroed_kwargs))
        except Exception:  # not what the module runs on after all: no verdict
            return None
        for reader in readers:
            cut_inputs(copies[names[id(reader)]], keep)
        cut_args, cut_kwargs = _with(call, place, x.index_select(dim, keep))
        try:
            got = output_tensors(edited(*cut_args, **cut_kwargs))
        except Exception as error:  # its code reads the old width
            return f"fails cut to the kept channels ({type(error).__name__}: {error})"
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want, strict=True)):
        return None
    if all(close(g, w) for g, w in zip(got, want, strict=True)):
        return None
    return "computes other values cut to the kept channels than with the removed ones zeroed"


def enclosing_reader_refusals(
    model: nn.Module, groups: Sequence[ChannelGroup], inputs: tuple
) -> dict[str, list[str]]:
    """For each group read inside a module that fails its proof (see the module
    docstring), the group's name and that module, one line a module."""
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    checks: dict[tuple[str, str], list[nn.Module]] = {}  # (group, module): its readers
    by_name = {g.name: g for g in groups}
    for group in groups:
        members = _members(group)
        for reader in group.kept_in:
            if not _provable(group, reader) or id(reader) not in names:
                continue
            outer = _enclosing(names[id(reader)], modules, members)
            if outer is not None:
                checks.setdefault((group.name, outer), []).append(reader)
    if not checks:
        return {}
    watched = {n: modules[n] for _, n in checks} | {
        names[id(r)]: r for readers in checks.values() for r in readers
    }
    calls = example_calls(model, list(watched.values()), inputs)
    refused: dict[str, list[str]] = {}
    for (group_name, outer), readers in checks.items():
        module, group = modules[outer], by_name[group_name]
        if module not in calls or any(r not in calls or not calls[r][0] for r in readers):
            continue  # not run by the example, or a reader called by keywords alone
        x = calls[readers[0]][0][0]
        if not isinstance(x, torch.Tensor) or any(calls[r][0][0] is not x for r in readers):
            continue  # its readers read different tensors (or a packed sequence)
        places = _located(calls[module], x)
        dim = channel_dim(readers[0])
        width = group.size * group.channels_per_unit
        if len(places) != 1 or x.shape[dim] != width:
            continue  # its readers see a tensor it made, or the channels are not all of it
        failure = proof_failure(module, calls[module], places[0][0], dim, readers, group)
        if failure is not None:
            refused.setdefault(group_name, []).append(
                f"{type(module).__name__} {outer!r} (through "
                f"{', '.join(repr(names[id(r)]) for r in readers)}), which {failure}"
            )
    return refused
