"""The search for the channels coupled to a layer's channels in Torch-Pruning's graph.

`coupled_group` returns the group Torch-Pruning's `get_pruning_group` returns (tested
item by item where that search ends), with two differences:

- Each (node, pruning function) goes on only with the indices it has not reached
  before. Torch-Pruning's goes on through a node whenever it reaches it with another
  list of indices, and compares each list with every item found so far; the union is
  the same (the index mappings map each index alone), and here each index is followed
  once, so the work is bounded by the nodes times the channels.
- An index past the width of a layer it reaches ends the search: the group comes back
  marked `UNFOLLOWED`, and the pruner leaves it whole. Only a wrong mapping gives one:
  the graph maps an attention's views of its channels into heads (EfficientViT's,
  CoAtNet's, FocalNet's modulation) as if they flattened them, and a cycle through such
  a view maps indices to ever larger ones; Torch-Pruning's search never ended there.
  So does an index past the number of elements of the view's tensor (its autograd
  node keeps its sizes), or of the largest tensor the tracing forward made
  (`LargestTensor`), found before a mapping that flattens makes it: two such views in a
  row (GCNet's attention pooling, viewed as flattening its channels twice) would first
  make a list of each channel times the square of the area.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch_pruning as tp
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch_pruning import _helpers
from torch_pruning.dependency import index_mapping
from torch_pruning.dependency.dependency import Dependency
from torch_pruning.dependency.group import Group

# Torch-Pruning's own nodes for the tensor ops between layers, and for the model's outputs
TENSOR_OPS = (
    tp.ops._ElementWiseOp,
    tp.ops._ReshapeOp,
    tp.ops._SliceOp,
    tp.ops._SplitOp,
    tp.ops._ConcatOp,
    tp.ops._UnbindOp,
    tp.ops._ExpandOp,
    tp.ops._OutputOp,
)

# the attribute set (True) on a group whose search reached an index past a layer's width
UNFOLLOWED = "dtp_unfollowed"


# the attribute holding, on a graph, the number of elements of the largest tensor its
# tracing forward made (LargestTensor): no index of a channel's can reach it
LARGEST_TENSOR = "dtp_largest_tensor"


class LargestTensor(TorchFunctionMode):
    """Within the block, `numel` is the number of elements of the largest tensor a torch
    function (or tensor method) returned."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):  # results nested in tuples and lists too
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


# the attribute set (True) on a graph while its index mappings are held (mappings_held)
MAPPINGS_HELD = "dtp_mappings_held"


@contextlib.contextmanager
def mappings_held(graph: tp.DependencyGraph) -> Iterator[None]:
    """Within the block, the graph's index mappings are updated once, not before each
    search (as Torch-Pruning does, for the widths its pruning changes): for searches with
    nothing pruned between them. On some models an update takes longer than a search
    (0.2 s on EfficientViT, for each of its 90 roots)."""
    index_mapping.update_index_mapping(graph)
    setattr(graph, MAPPINGS_HELD, True)
    try:
        yield
    finally:
        setattr(graph, MAPPINGS_HELD, False)


def _width(graph: tp.DependencyGraph, node, handler: Callable) -> int | None:
    """The number of channels `handler` cuts from the layer at `node` (its outputs' or its
    inputs'), or None for a tensor op, whose width the graph does not hold."""
    if isinstance(node.module, TENSOR_OPS):
        return None
    if graph.is_out_channel_pruning_fn(handler):
        width = graph.get_out_channels(node)
    elif graph.is_in_channel_pruning_fn(handler):
        width = graph.get_in_channels(node)
    else:
        return None
    return width if isinstance(width, int) else None


def coupled_group(
    graph: tp.DependencyGraph, module: nn.Module, handler: Callable, idxs: Sequence[int] | int
) -> Group:
    """The group of `idxs` of `module` under `handler`, with the items and indices
    `graph.get_pruning_group` gives: one item per (node, pruning function) in the order
    first reached, the root's first, its indices in the order first reached (Torch-
    Pruning's order too, unless its search reaches a node again with new indices). (The
    pruner's graphs ignore no parameters: Torch-Pruning's search leaves out those it is
    told to.)"""
    if module not in graph.module2node:
        raise ValueError(f"{type(module).__name__} is not in the dependency graph")
    if (
        isinstance(module, tp.ops.TORCH_CONV)
        and module.groups == module.out_channels
        and module.out_channels > 1
    ):  # Torch-Pruning's own rule: a depthwise conv's channels go with its inputs
        handler = tp.prune_depthwise_conv_out_channels
    if isinstance(idxs, int):
        idxs = [idxs]
    if not getattr(graph, MAPPINGS_HELD, False):  # the widths may have changed (export)
        index_mapping.update_index_mapping(graph)

    root = graph.module2node[module]
    start = [_helpers._HybridIndex(idx=i, root_idx=i) for i in idxs]
    # per (node, pruning function): the first dependency reaching it, and its indices
    reached: dict[tuple, tuple[Dependency, dict[int, _helpers._HybridIndex]]] = {
        (root, handler): (
            Dependency(handler, handler, source=root, target=root),
            {i.idx: i for i in start},
        )
    }
    stack = [(root, handler, start)]
    largest = getattr(graph, LARGEST_TENSOR, None)
    widths: dict[tuple, int | None] = {}
    unfollowed = False
    while stack and not unfollowed:
        node, fn, indices = stack.pop()
        for dep in node.dependencies:
            if not dep.is_triggered_by(fn):
                continue
            mapped = indices
            for mapping in dep.index_mapping:
                if mapping is not None and _past(mapping, mapped, _bound(dep, largest)):
                    unfollowed = True
                    break
                if mapping is not None:
                    mapped = mapping(mapped)
            if unfollowed:
                break
            key = (dep.target, dep.handler)
            seen = reached[key][1] if key in reached else {}
            fresh = {}
            for index in mapped:
                if index.idx not in seen and index.idx not in fresh:
                    fresh[index.idx] = index
            if key not in widths:
                widths[key] = _width(graph, dep.target, dep.handler)
            if widths[key] is not None and any(i >= widths[key] for i in fresh):
                unfollowed = True  # a wrong mapping on the way: its indices mean nothing
                break
            if fresh:
                reached.setdefault(key, (dep, seen))[1].update(fresh)
                stack.append((dep.target, dep.handler, list(fresh.values())))

    group = Group()
    for dep, first_reached in reached.values():
        group.add_dep(dep, list(first_reached))
        group[-1].root_idxs = [index.root_idx for index in first_reached.values()]
    group._DG = graph
    setattr(group, UNFOLLOWED, unfollowed)
    return group


def _bound(dep: Dependency, largest: int | None) -> int | None:
    """No index can reach this many elements on `dep`'s way: the largest tensor's, or,
    where either end is a view whose autograd node kept its input's sizes, that tensor's
    (a view keeps its number of elements)."""
    bounds = [largest] if largest is not None else []
    for node in (dep.source, dep.target):
        sizes = getattr(getattr(node, "grad_fn", None), "_saved_self_sym_sizes", None)
        if isinstance(node.module, tp.ops._ReshapeOp) and sizes is not None:
            bounds.append(math.prod(int(size) for size in sizes))
    return min(bounds, default=None)


def _past(mapping, indices: list, bound: int | None) -> bool:
    """Whether `mapping`, a view flattening each index into `stride` of them, would map
    `indices` to `bound` or past it."""
    return (
        bound is not None
        and isinstance(mapping, index_mapping._FlattenIndexMapping)
        and not mapping.reverse
        and bool(indices)
        and (max(i.idx for i in indices) + 1) * mapping._stride > bound
    )
