"""Global response normalizations (ConvNeXt V2's GRN, timm's and Hugging Face's) inside an
MLP's hidden width, kept exact when the width's channels go.

A GRN divides each channel's spatial L2 norm g_c by the mean of all channels' norms:

    y = x + bias + weight * x * g / (mean_C(g) + eps)

so a channel removed changes the mean the others are divided by. The hard mask zeroes
the removed channels before it (the root layer's rows) and their bias in it, so they add
nothing to the sum and leave it as zeros; with S the sum of the K kept channels' norms
of C,

    g / (S / C + eps)  ==  (C / K) * g / (S / K + eps * C / K)

so the exported GRN, cut to the kept channels, has its weight and its eps scaled by
C / K and computes exactly what the masked one did. Hugging Face's ConvNextV2GRN fixes
eps at 1e-6 in its code: there only the weight is scaled, and the exported layer's
normalized term differs from the masked one's by a relative 1e-6 * (C / K - 1) / mean(g)
at most, mean(g) = S / K the kept channels' mean norm: 1e-6 for half the channels kept
and a mean norm of 1 (g is an L2 norm over all H x W positions), within export()'s 1e-4
check for any mean norm above 0.01 * (C / K - 1); the proof below and that check
confirm it on the example. A module is taken for such a norm only when this is shown on
a copy of it, with random parameters, on its input in the example forward; any other
norm over the channels stays among those refused.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .groups import ChannelGroup, is_response_norm_shaped
from .module_tensors import tensor_of
from .precision import ieee_fp32
from .proof import close, dropped, example_calls, random_half


def cut_response_norm(norm: nn.Module, keep: torch.Tensor) -> None:
    """Keep the channels `keep` (sorted indices) of `norm`'s weight and bias (their last
    dimension), in place: what Torch-Pruning's export does to them."""
    for name in ("weight", "bias"):
        param = getattr(norm, name)
        setattr(norm, name, nn.Parameter(param.detach().index_select(-1, keep.to(param.device))))


def rescale_response_norm(norm: nn.Module, width: int, kept: int) -> None:
    """Scale `norm`'s weight, and its eps where it has one, by `width / kept`, once cut
    from `width` channels to `kept` (see the module docstring)."""
    factor = width / kept
    weight = tensor_of(norm).detach()
    wide = torch.promote_types(weight.dtype, torch.float32)  # half precision: one rounding
    norm.weight = nn.Parameter((weight.to(wide) * factor).to(weight.dtype))
    eps = getattr(norm, "eps", None)
    if isinstance(eps, float):  # (setattr: mypy types a module's attributes as tensors)
        setattr(norm, "eps", eps * factor)  # noqa: B010


def rescales_exactly(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether `norm`, cut to a random half of its channels and rescaled, computes on
    them what it computes with the others zeroed (and their bias masked), which it leaves
    zero: shown on a copy with random parameters, on its example input `x`, for a dim of
    `x` of the norm's width (its channels)."""
    width = tensor_of(norm).shape[-1]
    generator = torch.Generator().manual_seed(0)
    keep = random_half(width, generator)
    probe = copy.deepcopy(norm)
    probe.eval()
    with torch.no_grad():
        for param in probe.parameters():
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    dims = [d for d in range(1, x.dim()) if x.shape[d] == width]
    return any(_rescales_along(probe, x, d, keep) for d in dims)


def _rescales_along(probe: nn.Module, x: torch.Tensor, dim: int, keep: torch.Tensor) -> bool:
    device = x.device
    gone = dropped(x.shape[dim], keep, device)
    keep = keep.to(device)
    masked, cut = copy.deepcopy(probe), copy.deepcopy(probe)
    try:
        with torch.no_grad(), ieee_fp32():  # TF32 would round the two apart
            tensor_of(masked, "bias")[..., gone] = 0
            want = masked(x.index_fill(dim, gone, 0))
            cut_response_norm(cut, keep)
            rescale_response_norm(cut, x.shape[dim], len(keep))
            got = cut(x.index_select(dim, keep))
    except Exception:  # its code reads the old width, or these are not its channels
        return False
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return False
    if torch.any(want.index_select(dim, gone) != 0):  # the consumer's cut would miss them
        return False
    return close(got, want.index_select(dim, keep))


def adopt_response_norms(model: nn.Module, groups: Sequence[ChannelGroup], inputs: tuple) -> None:
    """Give each group whose channels pass through one GRN that rescales exactly on its
    example input that GRN as `group.response_norms` (its bias takes the mask too),
    taken from the group's refused norms. Only groups masked at their root's rows, one
    channel a unit (not a gated or residual-coupled group, or one through a GroupNorm,
    whose masks are elsewhere)."""
    candidates = [
        (group, norm)
        for group in groups
        if not group.gated and not group.producers and group.group_norm is None
        for norm in group.param_owners
        if is_response_norm_shaped(norm, group.size)
    ]
    calls = example_calls(model, [norm for _, norm in candidates], inputs)
    proven: dict[int, list[nn.Module]] = {}
    for group, norm in candidates:
        args, kwargs = calls.get(norm, ((), {}))
        one_tensor = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
        if one_tensor and rescales_exactly(norm, args[0]):
            proven.setdefault(id(group), []).append(norm)
    for group in groups:
        norms = proven.get(id(group), [])
        if len(norms) == 1:  # the one form seen (ConvNeXt V2); two in a row stay refused
            group.response_norms = norms  # its parameters counted as a cut norm's
            group.scales = [s for s in group.scales if s[0] is not norms[0]]
            group.norms = [n for n in group.norms if n is not norms[0]]
