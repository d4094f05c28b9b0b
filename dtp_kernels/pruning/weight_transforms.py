"""Conv and linear layers whose forward transforms their weight before using it, proven
before their channels are pruned.

Weight standardization (BiT's convs: Hugging Face's WeightStandardizedConv2d, timm's
StdConv2d; NFNet's ScaledStdConv2d) normalizes each filter over all its input channels,
so a filter cut to the kept inputs is normalized by other statistics than the masked
model used, and a mask that scales a filter's rows is divided out again. Either way the
exported model would not compute what the hard-masked one does, which export() would
only find after training. A layer of a conv or linear class whose class overrides
`forward` is therefore proven on a copy, on the input the example forward gave it: as a
consumer, cut to a random half of its input channels it must compute what it computes
with the others zeroed; where a mask goes on its rows, scaling them must scale its
outputs alike. A plain subclass that only pads first (timm's Conv2dSame) passes; a group
with a layer that fails is refused by name.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .cuts import channel_dim, cut_inputs
from .groups import ChannelGroup
from .module_tensors import tensor_of
from .precision import ieee_fp32
from .proof import close, dropped, example_calls, random_half

PLAIN_FORWARDS = {cls.forward: cls for cls in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)}


def overrides_forward(module: nn.Module) -> bool:
    """Whether `module` is a conv or linear layer (not grouped) whose class computes its
    forward by code of its own."""
    if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return False
    return getattr(module, "groups", 1) == 1 and type(module).forward not in PLAIN_FORWARDS


def cuts_inputs_exactly(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer`, its weight cut to a random half of its input channels, computes
    on them what it computes on `x` with the other channels zeroed."""
    dim = channel_dim(layer)
    width = x.shape[dim]
    keep = random_half(width, torch.Generator().manual_seed(0)).to(x.device)
    cut = copy.deepcopy(layer)
    try:
        with torch.no_grad(), ieee_fp32():  # TF32 would round the two apart
            want = cut(x.index_fill(dim, dropped(width, keep, x.device), 0))
            cut_inputs(cut, keep)
            got = cut(x.index_select(dim, keep))
    except Exception:  # its code reads the old width
        return False
    return isinstance(got, torch.Tensor) and close(got, want)


def scales_rows_exactly(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer`, its weight's rows (and bias) scaled by a mask of zeros and values
    in [0.5, 1.5), computes on `x` its outputs scaled by that mask: what a mask on its
    rows is taken to do."""
    weight = tensor_of(layer)
    out = weight.shape[0]
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(out, generator=generator) + 0.5
    mask[random_half(out, generator)] = 0
    mask = mask.to(device=x.device, dtype=weight.dtype)
    scaled = copy.deepcopy(layer)
    shape = (-1,) + (1,) * (weight.dim() - 1)
    try:
        with torch.no_grad(), ieee_fp32():
            want = scaled(x)
            view = [1] * want.dim()
            view[channel_dim(layer)] = out
            want = want * mask.view(view)
            tensor_of(scaled).mul_(mask.view(shape))
            bias = scaled.bias
            if isinstance(bias, torch.Tensor):
                bias.mul_(mask)
            got = scaled(x)
    except Exception:
        return False
    return close(got, want)


def _mask_rows(group: ChannelGroup) -> list[nn.Module]:
    """The conv or linear layers whose rows take the group's mask (with
    mask_at="activation" the epilogue masks their outputs instead, but the proof does
    not know the pruner's choice and asks for what "auto" does)."""
    if group.gated or group.bn is not None or group.group_norm is not None:
        return []
    targets = [target for _, target in group.producers] or [group.rows]
    return [t for t in targets if isinstance(t, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]


def weight_transform_refusals(
    model: nn.Module, groups: Sequence[ChannelGroup], inputs: tuple
) -> dict[str, list[str]]:
    """For each group with a layer that fails its proof (see the module docstring), the
    group's name and what fails, one line a layer."""
    checks = [
        (group, layer, check)
        for group in groups
        for layers, check in (
            (group.kept_in, cuts_inputs_exactly),
            (_mask_rows(group), scales_rows_exactly),
        )
        for layer in layers
        if overrides_forward(layer)
    ]
    layers = list({id(layer): layer for _, layer, _ in checks}.values())
    calls = example_calls(model, layers, inputs)
    names = {module: name for name, module in model.named_modules()}
    what = {
        cuts_inputs_exactly: "cut to fewer input channels, computes other values for the "
        "kept ones than with the removed ones zeroed",
        scales_rows_exactly: "whose rows take the mask, does not scale its outputs as its "
        "filters are scaled",
    }
    refused: dict[str, list[str]] = {}
    for group, layer, check in checks:
        args, kwargs = calls.get(layer, ((), {}))
        one_tensor = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
        if one_tensor and check(layer, args[0]):
            continue
        why = what[check] if one_tensor else "is not run on one tensor by the example inputs"
        refused.setdefault(group.name, []).append(f"{type(layer).__name__} {names[layer]!r}, {why}")
    return refused
