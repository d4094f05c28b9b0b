"""Channels that scale themselves through a squeeze-and-excitation block (EfficientNet,
MobileNetV3, RegNetY, SE-ResNet; torchvision's and timm's).

A squeeze-and-excitation block pools the channels, passes them through two small layers
and multiplies each channel by the second layer's output. That layer writes the
channels' width too, so Torch-Pruning couples its outputs with the layer that makes the
channels: the group has two producers. One mask still covers it exactly when every
layer that reads the channels reads zero wherever the mask is zero: the mask goes where
it goes for any group (the last BN or depthwise conv of the channels' path), and from
there a channel stays zero through zero-preserving activations, pooling and reshapes,
and through a product with anything (the excitation's scale). Each reader's inputs are
walked back through Torch-Pruning's graph to prove it; a group where any reader fails
(the scale added rather than multiplied, a reader before the mask) is left whole.
"""

from __future__ import annotations

import torch_pruning as tp
from torch import nn

# unary ops that map 0 to 0, by their autograd names (a sigmoid does not: it is the
# excitation's own gate, reached only through the product)
ZERO_PRESERVING = (
    "ReluBackward",
    "HardtanhBackward",
    "SiluBackward",
    "HardswishBackward",
    "GeluBackward",
    "MishBackward",
    "LeakyReluBackward",
    "EluBackward",
    "TanhBackward",
    "MeanBackward",
    "AdaptiveAvgPool",
    "AvgPool",
    "AdaptiveMaxPool",
    "MaxPool",
    "CloneBackward",
    "ToCopyBackward",
)


# Torch-Pruning's nodes for ops that are not layers, which a channel passes through
THROUGH = (tp.ops._ElementWiseOp, tp.ops._ReshapeOp)


def _op(node) -> str:
    module = node.module
    return str(getattr(module, "_grad_fn", "")) if isinstance(module, tp.ops._ElementWiseOp) else ""


def _zero_where_masked(node, mask_at: nn.Module, memo: dict[int, bool]) -> bool:
    """Whether `node`'s output is zero in a channel whose mask at `mask_at` is zero."""
    key = id(node)
    if key not in memo:
        memo[key] = False  # a cycle (none in a forward's graph) proves nothing
        op = _op(node)
        if node.module is mask_at:
            zero = True
        elif op.startswith("MulBackward"):
            zero = any(_zero_where_masked(i, mask_at, memo) for i in node.inputs)
        elif len(node.inputs) == 1 and (
            op.startswith(ZERO_PRESERVING) or isinstance(node.module, tp.ops._ReshapeOp)
        ):
            zero = _zero_where_masked(node.inputs[0], mask_at, memo)
        else:
            zero = False
        memo[key] = zero
    return memo[key]


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
    readers: list[nn.Module],
) -> nn.Module | None:
    """The layer making a group's channels when its other producers are excitations
    whose outputs only scale them and every reader reads zero where the mask (at
    `mask_at`, one of the channels' per-channel modules `path`) is zero; None when that
    is not proven."""
    if mask_at is None:
        return None
    root = _producer_of(graph, mask_at, producers, path)
    if root is None:
        return None
    memo: dict[int, bool] = {}
    for reader in readers:
        inputs = graph.module2node[reader].inputs
        if not inputs or not all(_zero_where_masked(i, mask_at, memo) for i in inputs):
            return None
    return root
