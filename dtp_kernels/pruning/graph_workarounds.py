"""Where Torch-Pruning 1.6.1's graph fails on code it could follow, and how the pruner
lets it through.

- A concatenation one of whose inputs has a width it cannot infer (an addition of
  tensors no layer produced, as rotary embeddings and position tables make): its code
  leaves such a concatenation unmapped, but it sums the widths before it checks them,
  and the sum of an int and None fails the whole graph (MiniMax's, ProphetNet's). Inside
  `unknown_concat_widths_left_unmapped()` the concatenation is left unmapped, as its
  code means to: the groups that meet a concatenation are left whole by the pruner
  anyway (groups.py), and export checks the rest. So is one whose width inference reads
  a part of a split it recorded fewer parts of (IndexError: DINOv3's concatenation of
  its prefix tokens with the rotated patches).
- A subclass of `nn.Linear` whose forward returns a tuple (the routers of PhiMoE and
  Llama 4, which return their logits with the experts chosen): its tracing hook reads
  `.shape` of a linear layer's output before it unpacks a tuple, and fails.
  `tuple_returning_linears()` names them, to be left out of the trace (their outputs
  are routing logits, one per expert, never a prunable width).
- A region pooling op of torchvision (roi_align, roi_pool and their position-sensitive
  forms) reads the boxes as well as the features, and the graph takes it for an
  elementwise op of both: the boxes' four coordinates become coupled to the features'
  channels. Where detections are pooled again (Keypoint R-CNN's keypoint head reads the
  boxes its box head predicted), the search for the box regressor's group then never
  ends. Inside `region_pooling_reads_features_only()` such an op keeps only its
  features as an input.
- A channel shuffle (ShuffleNet's: a view to (batch, groups, channels / groups, h, w),
  a transpose, a view back): the graph's width inference divides by zero on some of
  these reshapes, which fails the whole graph, and maps the others as if they kept or
  flattened the channels' order, which a shuffle permutes. Inside
  `unmappable_reshapes_marked()` a reshape of a tensor of five or more dimensions (the
  view back, where it divides by zero) is left unmapped and marked (`UNMAPPED_RESHAPE`),
  unless it leaves every channel of a video's or a volume's (N, C, D, H, W) where it was
  (an instance norm's own reshapes, a pooled map flattened) or flattens the leading
  dimensions of features last into a linear layer's matmul (Video Swin's MLPs);
  the layers whose channels reach one are left whole with no search (groups.py), so no
  group passes one. torchvision's Swin merges its windows back the same way. So is any
  other reshape whose widths the inference takes for 0 and divides by (SHViT's view of
  its attention output, (batch, channels, tokens), back to an image).
- A reshape that merges the channels with the dimensions after them but not all of
  them ((N, C, H, W) to (N, C * H, W): a CRNN's feature map turned into a sequence of
  C * H features per column for its LSTM or linear layer): the graph maps only a
  flatten of all of them, and leaves this one unmapped, so channel c would be taken
  for feature c of the C * H. Inside `unmappable_reshapes_marked()` it is mapped as a
  flatten of H features per channel (`_merged_channels`).
- A slice of the channels (`x[:, :c]`): the graph's width inference reads through it
  the width of the tensor sliced, so a concatenation of slices (timm's ReXNet adds its
  shortcut into the first channels: `cat([x[:, :c] + shortcut, x[:, c:]])`) gets
  offsets past its width, and the groups through it hold channels that do not exist.
  Inside `slice_widths_inferred()` a slice of the channels has the width it keeps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch_pruning as tp
from torch import nn
from torch_pruning.dependency import index_mapping

from .example_inputs import call_model


@contextlib.contextmanager
def unknown_concat_widths_left_unmapped() -> Iterator[None]:
    """Within the block, a concatenation whose input widths Torch-Pruning cannot all infer
    gets no index mapping instead of failing the graph; any other error stays."""
    update = index_mapping.update_concat_index_mapping

    def tolerant(graph, node) -> None:
        try:
            update(graph, node)
        except TypeError:
            widths = getattr(node.module, "concat_sizes", None)
            if widths is None or None not in widths:
                raise
        except IndexError:  # a width read from a split it recorded fewer parts of
            pass

    index_mapping.update_concat_index_mapping = tolerant
    try:
        yield
    finally:
        index_mapping.update_concat_index_mapping = update


# the attribute set on a reshape op's node module that the graph left unmapped
UNMAPPED_RESHAPE = "dtp_unmapped_reshape"


def _input_sizes(grad_fn) -> tuple:
    """The input shape a reshape's autograd node saved (its attribute's name differs
    between torch versions), or ()."""
    for name in ("_saved_self_sym_sizes", "_saved_self_sizes"):
        sizes = getattr(grad_fn, name, None)
        if sizes is not None:
            return tuple(sizes)
    return ()


def _output_sizes(grad_fn) -> tuple | None:
    """The shape a reshape's autograd node gave (its gradient's), or None where torch
    does not say."""
    metadata = getattr(grad_fn, "_input_metadata", None)
    return tuple(metadata[0].shape) if metadata else None


def _keeps_channels(before: tuple, after: tuple | None) -> bool:
    """Whether a reshape of `before` (N, C, ...) into `after` leaves every channel where
    it was: the same shape; the batch folded into the channels or back, the rest as it
    was (an instance norm over a video's or a volume's maps: (N, C, ...) to (1, N * C,
    ...) and back); or (N, C, 1, ..., 1) flattened to (N, C) (a pooled map)."""
    if after is None or len(before) < 2 or len(after) < 2:
        return False
    if after == before:
        return True
    rest = before[2:] == after[2:]
    if rest and after[:2] == (1, before[0] * before[1]):  # the batch folded in
        return True
    if rest and before[:2] == (1, after[0] * after[1]):  # and back
        return True
    return after == before[:2] and all(size == 1 for size in before[2:])


def _merged_channels(before: tuple, after: tuple | None) -> int | None:
    """How many features each channel becomes where a reshape of `before` (N, C, ...)
    into `after` merges the channels with the dimensions after them and keeps the
    batch and the dimensions after those: (N, C, H, W) into (N, C * H, W) gives H.
    None for any other reshape (a flatten of all of them is Torch-Pruning's own)."""
    if after is None or len(before) < 4 or len(after) < 3 or after[0] != before[0]:
        return None
    for end in range(3, len(before)):  # the dimensions before[2:end] merged in
        if after[1:] == (math.prod(before[1:end]), *before[end:]):
            return math.prod(before[2:end]) if math.prod(before[2:end]) > 1 else None
    return None


def _map_flatten(node, stride: int) -> None:
    """Map `node`, a reshape, as a flatten of `stride` features per channel of its
    input, both ways (as Torch-Pruning maps a flatten it recognises)."""
    for source in node.inputs:
        for dep in node.dependencies:
            if dep.target == source:
                dep.index_mapping[0] = index_mapping._FlattenIndexMapping(stride, reverse=True)
        for dep in source.dependencies:
            if dep.target == node:
                dep.index_mapping[0] = index_mapping._FlattenIndexMapping(stride, reverse=False)


# how autograd names a linear layer's own matmul of a 2-D input
LINEAR_MATMULS = ("AddmmBackward", "MmBackward")


def _into_linear(node, before: tuple, after: tuple | None) -> bool:
    """Whether the reshape `node` flattens the leading dimensions of `before` (features
    last) into the rows of a linear layer's matmul, which all its outputs are: the
    features stay last, where the layer reads them."""
    if after is None or len(after) != 2 or after != (math.prod(before[:-1]), before[-1]):
        return False
    names = [str(getattr(out.module, "_grad_fn", "")) for out in node.outputs]
    return bool(names) and all(name.startswith(LINEAR_MATMULS) for name in names)


@contextlib.contextmanager
def unmappable_reshapes_marked() -> Iterator[None]:
    """Within the block, a reshape of a tensor of five or more dimensions that may move
    its channels (all but those of `_keeps_channels` and `_into_linear`), or one whose
    mapping divides by zero, is left unmapped and marked with UNMAPPED_RESHAPE
    (Torch-Pruning's width inference divides by zero on a channel shuffle's and on
    SHViT's); one merging the channels with some of the dimensions after them is
    mapped as a flatten (`_merged_channels`); the others are mapped as Torch-Pruning
    maps them."""
    update = index_mapping.update_reshape_index_mapping

    def marking(graph, node) -> None:
        sizes, after = _input_sizes(node.grad_fn), _output_sizes(node.grad_fn)
        if (
            len(sizes) >= 5
            and not _keeps_channels(sizes, after)
            and not _into_linear(node, sizes, after)
        ):
            # a split dimension merged back, as after a shuffle's transpose: the channels
            # come out permuted, which no index mapping of the graph expresses
            setattr(node.module, UNMAPPED_RESHAPE, True)
            return
        try:
            update(graph, node)
        except ZeroDivisionError:  # widths it infers as 0 (SHViT's attention output)
            setattr(node.module, UNMAPPED_RESHAPE, True)
            return
        stride = _merged_channels(sizes, after)
        mapped = any(m is not None for d in node.dependencies for m in d.index_mapping)
        if stride is not None and not mapped:
            _map_flatten(node, stride)

    index_mapping.update_reshape_index_mapping = marking
    try:
        yield
    finally:
        index_mapping.update_reshape_index_mapping = update


def tuple_returning_linears(model: nn.Module, example_inputs: tuple) -> list[nn.Module]:
    """The `nn.Linear` subclasses in `model` with a forward of their own that returns a
    tuple on `example_inputs`, found in one eval forward (run under the caller's
    settings: channel_graph.py traces without the key/value cache); without such a subclass no
    forward is run."""
    candidates = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward
    ]
    if not candidates:
        return []
    outputs: dict[nn.Module, object] = {}

    def record(module, args, output):
        outputs.setdefault(module, output)

    handles = [m.register_forward_hook(record) for m in candidates]
    try:
        with torch.no_grad():
            was_training = model.training
            model.eval()
            try:
                call_model(model, example_inputs)
            finally:
                model.train(was_training)
    finally:
        for handle in handles:
            handle.remove()
    return [m for m in candidates if isinstance(outputs.get(m), tuple)]


def _channel_slice(grad_fn) -> tuple[int, range] | None:
    """(width sliced, channels kept) of a slice that the graph maps as one of the
    channels (its index mapping's rule: dim 1 of a 2-D or 4-D tensor, dim 2 of a 3-D
    one), or None."""
    sizes = tuple(getattr(grad_fn, "_saved_self_sym_sizes", ()))
    dim = getattr(grad_fn, "_saved_dim", None)
    if dim is None or {2: 1, 3: 2, 4: 1}.get(len(sizes)) != dim:
        return None
    width = int(sizes[dim])
    return width, range(width)[grad_fn._saved_start : grad_fn._saved_end : grad_fn._saved_step]


@contextlib.contextmanager
def slice_widths_inferred() -> Iterator[None]:
    """Within the block, the graph infers a slice of the channels to have the width it
    keeps (out) and the width it slices (in), where it read through it before."""
    pruner = tp.ops.SlicePruner
    had = {name: vars(pruner).get(name) for name in ("get_out_channels", "get_in_channels")}

    def out_channels(self, layer) -> int | None:
        sliced = _channel_slice(layer.grad_fn) if layer.grad_fn is not None else None
        return None if sliced is None else len(sliced[1])

    def in_channels(self, layer) -> int | None:
        sliced = _channel_slice(layer.grad_fn) if layer.grad_fn is not None else None
        return None if sliced is None else sliced[0]

    pruner.get_out_channels = out_channels
    pruner.get_in_channels = in_channels
    try:
        yield
    finally:
        for name, method in had.items():
            if method is None:
                delattr(pruner, name)
            else:
                setattr(pruner, name, method)


# the autograd names of torchvision's region pooling ops, whose first input is the features
REGION_POOLING = ("roi_align", "roi_pool")


@contextlib.contextmanager
def region_pooling_reads_features_only() -> Iterator[None]:
    """Within the block, a graph Torch-Pruning traces has each of torchvision's region
    pooling ops read only its features (its boxes' input cut), before the dependencies
    are built from its inputs."""
    trace = tp.DependencyGraph._trace

    def traced(graph, *args, **kwargs):
        module2node = trace(graph, *args, **kwargs)
        for node in module2node.values():
            grad_fn = getattr(node, "grad_fn", None)
            if not any(op in type(grad_fn).__name__.lower() for op in REGION_POOLING):
                continue
            features = grad_fn.next_functions[0][0] if grad_fn.next_functions else None
            kept = [n for n in node.inputs if n.grad_fn is features]
            if len(kept) != 1:  # the features not told apart: left as traced
                continue
            for other in node.inputs:
                if other is not kept[0]:
                    other.outputs = [n for n in other.outputs if n is not node]
            node.inputs = kept
        return module2node

    tp.DependencyGraph._trace = traced
    try:
        yield
    finally:
        tp.DependencyGraph._trace = trace
