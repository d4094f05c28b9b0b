"""Channels through grouped convolutions (ResNeXt's, RegNet's), pruned in equal numbers
from each of the convolution's groups.

A convolution of G groups reads its input channels [g n/G, (g+1) n/G) into its outputs
[g m/G, (g+1) m/G): its layout holds only when every group keeps as many input channels,
and as many output channels. A group of channels that a grouped convolution writes or
reads whole, in order, is then G transport segments of n/G channels, each keeping k/G
(under budget "layer"); the mask goes where it goes for any channel group (the BN after
the convolution that writes them). Export cuts the grouped convolution's input channels
group by group here: Torch-Pruning's cut keeps the same positions in every group.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TypeGuard

import torch
from torch import nn

from .ratios import kept_count

Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d


def is_grouped(module: nn.Module) -> TypeGuard[Conv]:
    """A grouped convolution that is not depthwise (ResNeXt, RegNet)."""
    return (
        isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        and module.groups > 1
        and not (module.groups == module.in_channels == module.out_channels)
    )


def equal_parts(writes: list[Conv], reads: dict[Conv, list[int]], size: int) -> int | None:
    """The number of equal parts the grouped convolutions that write (`writes`, their
    output channels) or read (`reads`: each with the input channels the group's channels
    0..size-1 map to) a group's `size` channels split them into: G when every one has G
    groups, writes or reads all the channels in order, and each part holds two or more;
    else None (not expressible as equal segments: the group is left whole)."""
    convs = [*writes, *reads]
    counts = {conv.groups for conv in convs}
    if len(counts) != 1:
        return None
    parts = counts.pop()
    if size // parts < 2:  # one channel per part (a depthwise conv with a multiplier
        return None  # reading them): none can go while every part keeps as many
    if any(conv.out_channels != size for conv in writes):
        return None
    if any(conv.in_channels != size or idxs != list(range(size)) for conv, idxs in reads.items()):
        return None
    return parts


def check_grouped_conv_ratios(groups: list, ratios: dict[str, float], budget: str) -> None:
    """ValueError, before any mask, when channels of grouped convolutions are asked to go
    under a budget other than "layer", or at a count their groups cannot keep alike."""
    pruned = [g for g in groups if getattr(g, "conv_groups", 1) > 1 and ratios[g.name] > 0]
    if not pruned:
        return
    if budget != "layer":
        raise ValueError(
            f"budget = {budget!r} cannot keep the same number of channels in each group of "
            f"a grouped convolution (layer {pruned[0].name!r} and {len(pruned) - 1} more), "
            "which the convolution's layout needs; use budget='layer', or leave them whole "
            "with ignored_layers=[...] or a ratio of 0 for them"
        )
    uneven = [g for g in pruned if kept_count(g.size, ratios[g.name]) % g.conv_groups]
    if uneven:
        common = ratios_keeping_parts_alike({g.size // g.conv_groups for g in uneven})
        details = "; ".join(
            f"layer {g.name!r}: ratio {ratios[g.name]} keeps {kept_count(g.size, ratios[g.name])}"
            f" of {g.size} channels in {g.conv_groups} groups of {g.size // g.conv_groups}"
            for g in uneven[:4]
        )
        more = f" (and {len(uneven) - 4} more layers)" if len(uneven) > 4 else ""
        raise ValueError(
            f"grouped convolutions keep the same number of channels in each of their groups, "
            f"so a kept count must be a multiple of the groups: {details}{more}. Ratios "
            f"every one of these layers can keep: {common}"
        )


def ratios_keeping_parts_alike(parts: set[int]) -> list[str]:
    """The ratios that keep as many of every part, for parts of each of the sizes
    `parts` (1 - j/n keeps j of every part of n), as text."""
    fits = [{Fraction(n - j, n) for j in range(1, n)} for n in parts]
    return [f"{float(r):g}" for r in sorted(set.intersection(*fits))]


def cut_grouped_inputs(conv: Conv, weight: torch.Tensor, keep: torch.Tensor) -> None:
    """Keep the input channels `keep` (sorted; as many from each group) of the grouped
    convolution `conv`, whose weight before the cut was `weight`, in place."""
    groups, per_group = conv.groups, weight.shape[1]
    local = keep.to(weight.device).view(groups, -1)
    local = local - per_group * torch.arange(groups, device=weight.device)[:, None]
    rows = local.repeat_interleave(weight.shape[0] // groups, dim=0)  # [out, kept / G]
    index = rows.view(*rows.shape, *[1] * (weight.dim() - 2)).expand(-1, -1, *weight.shape[2:])
    kept = weight.detach().gather(1, index).clone()
    conv.weight = nn.Parameter(kept, requires_grad=weight.requires_grad)
    conv.in_channels = len(keep)
