"""Channels that scale themselves through a squeeze-and-excitation block (EfficientNet,
MobileNetV3, RegNetY; torchvision's and timm's).

A squeeze-and-excitation block pools the channels, passes them through two small layers
and multiplies each channel by the second layer's output. That layer writes the
channels' width too, so Torch-Pruning couples its outputs with the layer that makes the
channels: the group has two producers. The one that makes the channels is the root (the
one the mask's module is computed from); the other only scales them, and the mask,
where it goes for any group, covers it when every reader of the channels reads zero
where the mask is zero, which groups.py proves for every group (masked_reads.py).
"""

from __future__ import annotations

import torch_pruning as tp
from torch import nn

from .masked_reads import MOVING_OPS

# Torch-Pruning's nodes for ops that are not layers, which a channel passes through
THROUGH = (tp.ops._ElementWiseOp, *MOVING_OPS)


def _producer_of(graph: tp.DependencyGraph, mask_at: nn.Module, producers: list, path: list):
    """The one producer that `mask_at` is computed from through the channels' per-channel
    modules (`path`: BNs, depthwise convs) and ops, or None."""
    found, stack, seen = [], [graph.module2node[mask_at]], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for source in node.inputs:
            if source.module in producers:
                found.append(source.module)
            elif source.module in path or isinstance(source.module, THROUGH):
                stack.append(source)
    return found[0] if len(set(found)) == 1 else None


def excited_root(
    graph: tp.DependencyGraph,
    producers: list[nn.Module],
    path: list[nn.Module],
    mask_at: nn.Module | None,
) -> nn.Module | None:
    """The producer making a group's channels, the one the module where the mask goes
    (`mask_at`, one of the channels' per-channel modules `path`) is computed from, when
    the group's other producers only scale them (proven with the group's readers); None
    when there is no such module or one producer."""
    if mask_at is None:
        return None
    return _producer_of(graph, mask_at, producers, path)
