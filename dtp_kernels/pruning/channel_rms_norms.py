"""RMS normalizations over a channel group's width (MobileNetV5's RmsNormAct2d after an
expansion conv and after the depthwise conv that follows it; its adapter's RmsNorm2d
after the norm of its last projection), kept exact when channels go.

Such a norm computes every channel from the mean square of all of them, so a removed
channel would still count in it. The hard mask zeroes the removed channels at the
root's rows, and a norm without a bias, an activation that maps zero to zero and a
depthwise conv without a bias keep them zero, so every norm of the group sees them as
zeros that count only in its denominator. With the kept channels x of K of N,

    w * x / sqrt(sum(x**2) / N + eps)  ==  (w / c) * (c * x) / sqrt(sum((c * x)**2) / K + eps)

for c = sqrt(K / N) (head_norms.py, for a norm over all heads). Export cuts each norm to
the kept channels and makes its input c times what the masked model gave it: the rows of
the layer that feeds it (the root, or a depthwise conv of the group) scaled by c and its
weight by 1 / c; a norm that feeds another norm directly keeps its weight, so that its
output, c times the masked one, is the next norm's input, whose weight takes the 1 / c.
Weights only: each norm's epsilon still describes the model.

A group is adopted only when all of this is shown on the example forward: each norm's
input is the output of the root, of a depthwise conv of the group or of another norm of
the group; with a random half of the root's output channels zeroed, every norm's and
every reader's input is zero at them; and each norm, a copy of it with a random weight,
cut and rescaled, computes on its example input what it computed with those channels
zeroed. Any other norm stays among those the pruner refuses; export() checks the whole
model again.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import nn

from .groups import ChannelGroup, _is_depthwise
from .module_tensors import tensor_of
from .precision import ieee_fp32
from .proof import close, dropped, example_calls, random_half, run_watched

# (norm, the module whose output is its input: a layer whose rows export scales, or a
# norm of the same group)
Fed = tuple[nn.Module, nn.Module]
CPU = torch.device("cpu")


def channel_dim(group: ChannelGroup) -> int:
    """The dim of the group's feature maps that holds its channels: a conv's 1, a linear
    layer's last."""
    return -1 if isinstance(group.layer, nn.Linear) else 1


def _candidates(groups: Sequence[ChannelGroup]) -> list[ChannelGroup]:
    """The groups refused for their norms alone, masked at their root's rows, one
    channel a unit, whose other producers are depthwise convs and whose other parameters
    are their norms' weights."""
    return [
        g
        for g in groups
        if g.norms
        and type(g) is ChannelGroup
        and not (g.gated or g.producers or g.response_norms or g.scales or g.reads)
        and not (g.channel_affines or g.shared_weights)
        and g.group_norm is None
        and g.bn is None
        and g.rows is g.layer
        and g.parts == 1
        and g.conv_groups == 1
        and all(m is g.layer or _is_depthwise(m) for m in g.kept_out)
        and set(g.param_owners) <= set(g.norms)
        and all(_weight_only(n, g.size) for n in g.norms)
    ]


def _weight_only(norm: nn.Module, width: int) -> bool:
    """Whether `norm`'s one parameter is a weight of `width` entries (no bias, nothing
    else)."""
    params = dict(norm.named_parameters())
    return set(params) == {"weight"} and params["weight"].shape == (width,)


def _feeders(
    model: nn.Module, inputs: tuple, groups: list[ChannelGroup]
) -> dict[nn.Module, tuple[nn.Module, bool]]:
    """Per group's norm, the module of its group that ran last before it (the root, a
    depthwise conv, another norm) and whether the norm's input is that module's output
    itself, seen in one eval forward; a norm before which none ran is absent."""
    owner = {m: id(g) for g in groups for m in [*g.kept_out, *g.norms]}
    last: dict[nn.Module, torch.Tensor] = {}  # each module's latest output, in running order
    fed: dict[nn.Module, tuple[nn.Module, bool]] = {}

    def produced(module, _args, output):
        last.pop(module, None)
        last[module] = output

    def normalizes(norm, args):
        ran = [m for m in last if owner[m] == owner[norm] and m is not norm]
        if args and ran and norm not in fed:
            fed[norm] = (ran[-1], args[0] is last[ran[-1]])

    handles = [m.register_forward_hook(produced) for m in owner]
    handles += [n.register_forward_pre_hook(normalizes) for g in groups for n in g.norms]
    run_watched(model, inputs, handles)
    return fed


def _scales_through(model: nn.Module, inputs: tuple, feeder: nn.Module, norm: nn.Module) -> bool:
    """Whether `norm`'s input doubles when `feeder`'s output does (what lies between, a
    pooling, is linear in it on the example), comparing its first input in two eval
    forwards."""
    seen: list[list[torch.Tensor]] = [[], []]

    def doubled(_module, _args, output):
        return output * 2

    def record(run: int):
        def hook(_norm, args):
            seen[run].append(args[0])

        return hook

    run_watched(model, inputs, [norm.register_forward_pre_hook(record(0))])
    run_watched(
        model,
        inputs,
        [feeder.register_forward_hook(doubled), norm.register_forward_pre_hook(record(1))],
    )
    if not (seen[0] and seen[1]) or seen[0][0].shape != seen[1][0].shape:
        return False
    return close(seen[1][0], seen[0][0] * 2)


def _zeros_reach(model: nn.Module, inputs: tuple, groups: list[ChannelGroup]) -> set[int]:
    """The ids of the groups whose norms and readers all see zeros at a random half of
    the root's output channels when the root's output is zeroed there (what the hard
    mask on its rows gives), in one eval forward with every group's half zeroed."""
    generator = torch.Generator().manual_seed(0)
    gone = {id(g): dropped(g.size, random_half(g.size, generator), CPU) for g in groups}
    failed: set[int] = set()
    reached: set[tuple[int, int]] = set()  # (group, module) pairs seen

    def zeroed(group: ChannelGroup):
        def hook(_module, _args, output):
            dim = channel_dim(group)
            if not isinstance(output, torch.Tensor) or output.shape[dim] != group.size:
                failed.add(id(group))
                return output
            return output.index_fill(dim, gone[id(group)].to(output.device), 0)

        return hook

    def sees_zeros(group: ChannelGroup):
        def hook(module, args):
            reached.add((id(group), id(module)))
            dim, x = channel_dim(group), args[0] if args else None
            wrong = not isinstance(x, torch.Tensor) or x.shape[dim] != group.size
            if wrong or torch.any(x.index_select(dim, gone[id(group)].to(x.device)) != 0):
                failed.add(id(group))

        return hook

    handles = [g.layer.register_forward_hook(zeroed(g)) for g in groups]
    for g in groups:
        watched = [*g.norms, *(m for m in g.kept_in if m not in g.kept_out)]
        handles += [m.register_forward_pre_hook(sees_zeros(g)) for m in watched]
    run_watched(model, inputs, handles)
    return {
        id(g)
        for g in groups
        if id(g) not in failed and all((id(g), id(n)) in reached for n in g.norms)
    }


def cut_and_rescale(norms: Sequence[Fed], width: int, kept: torch.Tensor) -> None:
    """Keep the `kept` channels of each norm of `norms` (in place, where export has not
    cut its weight already) and scale each norm's weight and its feeding layer's rows
    (cut already) so that it computes on them what it computed on all `width` channels
    with the others zero (see the module docstring). The modules are the export's."""
    scale = math.sqrt(len(kept) / width)
    feeding = {id(feeder) for _, feeder in norms}
    normed = {id(norm) for norm, _ in norms}
    for norm, feeder in norms:
        _cut_norm(norm, width, kept, 1.0 if id(norm) in feeding else 1 / scale)
        if id(feeder) not in normed:  # a layer: its rows
            names = ("weight", "bias") if feeder.bias is not None else ("weight",)
            for name in names:
                setattr(feeder, name, nn.Parameter(_scaled(getattr(feeder, name).detach(), scale)))


def _cut_norm(norm: nn.Module, width: int, kept: torch.Tensor, factor: float) -> None:
    """`norm`'s weight cut to `kept` (unless cut already) and scaled by `factor`."""
    weight = tensor_of(norm).detach()
    if weight.shape[0] == width:  # not cut by the graph's export
        weight = weight[kept.to(weight.device)]
    norm.weight = nn.Parameter(_scaled(weight, factor))
    if isinstance(getattr(norm, "normalized_shape", None), tuple):  # torch's, timm's
        # (setattr: mypy types a module's attributes as tensors or modules)
        setattr(norm, "normalized_shape", (len(kept),))  # noqa: B010


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return (tensor.float() * factor).to(tensor.dtype)  # one rounding in half precision


def _rescales_exactly(norm: nn.Module, x: torch.Tensor, dim: int) -> bool:
    """Whether `norm`, a copy with a random weight cut to a random half of its channels
    and rescaled, computes on them, given them c times larger, what it computes on its
    example input `x` with the others zeroed."""
    width = tensor_of(norm).shape[0]
    generator = torch.Generator().manual_seed(1)
    keep = random_half(width, generator).to(x.device)
    gone = dropped(width, keep, x.device)
    probe = copy.deepcopy(norm).eval()
    with torch.no_grad():
        tensor_of(probe).copy_(torch.rand(width, generator=generator) + 0.5)
    cut = copy.deepcopy(probe)
    scale = math.sqrt(len(keep) / width)
    try:
        with torch.no_grad(), ieee_fp32():
            want = probe(x.index_fill(dim, gone, 0))
            _cut_norm(cut, width, keep, 1 / scale)
            got = cut(x.index_select(dim, keep) * scale)
    except Exception:  # its code reads the old width, or these are not its channels
        return False
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return False
    return close(got, want.index_select(dim, keep))


def adopt_rms_norms(model: nn.Module, groups: Sequence[ChannelGroup], inputs: tuple) -> None:
    """Give each group whose norms are all shown exact when rescaled (see the module
    docstring) those norms, with what feeds each, as `group.rms_norms`, taken from its
    refused `norms`."""
    candidates = _candidates(groups)
    if not candidates:
        return
    feeders = _feeders(model, inputs, candidates)
    candidates = [g for g in candidates if all(n in feeders for n in g.norms)]
    fed = {norm: (norm, feeders[norm][0]) for g in candidates for norm in g.norms}
    reached = _zeros_reach(model, inputs, candidates)
    candidates = [  # what lies between a feeder and its norm, where anything does: linear
        g
        for g in candidates
        if id(g) in reached
        and all(feeders[n][1] or _scales_through(model, inputs, feeders[n][0], n) for n in g.norms)
    ]
    calls = example_calls(model, [n for g in candidates for n in g.norms], inputs)
    for group in candidates:
        proven = True
        for norm in group.norms:
            args, kwargs = calls.get(norm, ((), {}))
            one_tensor = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
            dim = channel_dim(group) % args[0].dim() if one_tensor else 0
            proven = proven and one_tensor and _rescales_exactly(norm, args[0], dim)
        if proven:
            group.rms_norms = [fed[n] for n in group.norms]
            group.norms = []
