"""Attention layers handed a bias for all the model's heads that add their own heads'
entries of it (ALiBi: BLOOM's, MPT's, Falcon's when built with it; WavLM's relative
position bias, which its first layer computes for all heads: wavlm_attention.py).

The model computes the bias once, for the heads it was built with, and hands the whole
of it to every layer. A layer that has lost heads must add each kept head's own entry,
not the first ones. Export gives such a layer a class (alibi_attention.py) that holds
the indices of its heads among the model's, as the buffer ``kept_heads``, and picks
their entries from the bias it is handed before the layer's own code runs; the model
still computes the bias for all its heads, so its slopes are the trained ones.
"""

from __future__ import annotations

import torch
from torch import nn

from .pruned_classes import GivenToTheLayer, pruned_classes


class PicksItsHeads(GivenToTheLayer):
    """A class export gives an attention layer handed a bias per head for all the
    model's heads: the layer itself, with the buffer `kept_heads` (the model's heads it
    computes, in order), whose forward picks their entries of the argument `picked`."""

    kept_heads: torch.Tensor  # the buffer: the model's heads the layer computes
    picked: str = ""  # the forward argument holding the bias for all the model's heads
    head_count: str = ""  # the layer's attribute holding its number of heads
    # its submodules that serve all the model's heads, kept whole (not per-head tables)
    whole: tuple[str, ...] = ()
    # its submodules run on each kept head apart: their FLOPs scale with the kept heads
    per_head: tuple[str, ...] = ()

    @classmethod
    def picks(cls, layer: nn.Module) -> bool:
        """Whether `layer` is handed the bias (a model may be built without ALiBi)."""
        return True

    @classmethod
    def from_dense(cls, layer: nn.Module) -> nn.Module:
        """`layer` itself, given this class, keeping all its heads (a loader then gives
        it the saved `kept_heads`)."""
        layer = super().from_dense(layer)
        if "kept_heads" not in layer._buffers:
            device = next(layer.parameters()).device
            heads = torch.arange(getattr(layer, cls.head_count), device=device)
            layer.register_buffer("kept_heads", heads)
        return layer


def picking_submodules(module: nn.Module, kind: str) -> list[nn.Module]:
    """The submodules of `module` its picking class names in `kind`: "whole" (kept whole
    for all the model's heads: WavLM's bias table) or "per_head" (run on each kept head
    apart); none for a layer that picks nothing."""
    if not picked_argument(module):
        return []
    cls = type(module) if isinstance(module, PicksItsHeads) else pruned_classes()[type(module)]
    return [sub for name in getattr(cls, kind) if (sub := getattr(module, name, None)) is not None]


def picked_argument(module: nn.Module) -> str:
    """The forward argument whose bias for all the model's heads `module` picks its own
    heads' entries of, once exported with heads removed (or already does); "" for a
    layer that does not."""
    cls = type(module) if isinstance(module, PicksItsHeads) else pruned_classes().get(type(module))
    if cls is None or not issubclass(cls, PicksItsHeads) or not cls.picks(module):
        return ""
    return cls.picked


def keep_heads(module: nn.Module, query_heads: torch.Tensor) -> None:
    """Give `module` (a layer of which `picked_argument` is not "", with the head count
    it had before export) its picking class, keeping the heads `query_heads` of those
    it computes: of the model's heads, for a layer exported before."""
    picking = module if isinstance(module, PicksItsHeads) else _picking(module)
    index = query_heads.to(picking.kept_heads.device)
    picking.kept_heads = picking.kept_heads.index_select(0, index)


def _picking(module: nn.Module) -> PicksItsHeads:
    """`module` given its picking class (pruned_classes maps its class to a subclass of
    PicksItsHeads and of the layer's own)."""
    cls = pruned_classes()[type(module)]
    if not issubclass(cls, PicksItsHeads):
        raise TypeError(f"{type(module).__name__} has no class that picks its heads")
    picking = cls.from_dense(module)
    assert isinstance(picking, PicksItsHeads)
    return picking
