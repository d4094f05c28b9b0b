"""Torch-Pruning's graph over a concatenation one of whose inputs has a width it cannot
infer.

Torch-Pruning 1.6.1 maps each concatenation's inputs to their offsets in its output, and
when it cannot infer an input's width (an addition of tensors no layer produced, as
rotary embeddings and position tables make) its code leaves the concatenation unmapped.
But it sums the widths before it checks them, so the sum of an int and None fails the
whole graph (MiniMax's, ProphetNet's). Inside `unknown_concat_widths_left_unmapped()`
such a concatenation is left unmapped, as its code means to: the groups that meet a
concatenation are left whole by the pruner anyway (groups.py), and export checks the
rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch_pruning.dependency import index_mapping


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

    index_mapping.update_concat_index_mapping = tolerant
    try:
        yield
    finally:
        index_mapping.update_concat_index_mapping = update
