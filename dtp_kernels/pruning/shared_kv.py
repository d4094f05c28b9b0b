"""Attention layers that read the keys and values of an earlier layer (KV sharing:
Gemma 3n's and Gemma 4's last layers).

In transformers' KV sharing, a "store" layer (``store_full_length_kv``) puts its keys
and values in the ``shared_kv_states`` it is handed, under its layer type, and every
later "reuse" layer of that type (``is_kv_shared_layer``: it has no key or value
projection) attends with its own queries over them. Removing a key/value head from the
store layer alone would leave the reuse layers' queries of that head with no key: the
store layer and its reuse layers are one group (:class:`SharedKVGroup`), one unit per
key/value head of the store layer with its query heads in every one of them, one mask
on every layer's output columns, named after the store layer. Where the store layer has
one key/value head (multi-query), each reuse layer's query heads are its own units, as
in the store layer, and need no tie.

Each layer is proven as every head group is (heads.py), a reuse layer with the keys and
values it is handed cut to the kept heads, as the exported store layer hands them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .attention_forms import READS_KV
from .head_group import HeadGroup
from .tied_heads import TiedHeadGroup

STORES = "store_full_length_kv"  # a store layer's flag
KV_ARGUMENT = "shared_kv_states"


@dataclass
class SharedKVGroup(TiedHeadGroup):
    """The heads of a store layer and of the reuse layers that read its keys and values:
    the same key/value heads, with their query heads, removed from every layer."""

    def cut_call(self, member: HeadGroup, call: tuple, keep: torch.Tensor) -> tuple:
        """A member's example call with a copy of the shared keys and values: a reuse
        layer's, of its type, cut to the key/value heads `keep` (what the exported store
        layer hands it); the store layer's as they are (the cut store layer writes its
        cut ones there, which the reuse layers' proofs must not read)."""
        args, kwargs = call
        bound = inspect.signature(member.module.forward).bind_partial(*args, **kwargs)
        states = dict(bound.arguments[KV_ARGUMENT])
        if member is not self.tied[0]:
            kind = member.module.layer_type
            key, value = states[kind]
            index = keep.to(key.device)
            states[kind] = (key.index_select(1, index), value.index_select(1, index))
        bound.arguments[KV_ARGUMENT] = states
        return bound.args, bound.kwargs


# why a reuse layer whose store layer is not pruned with it is refused
UNTIED = (
    "it reads the keys and values of an earlier layer (KV sharing) that is not pruned with "
    "it (left whole, or not an attention layer in a form the pruner knows)"
)


def _position(module: nn.Module) -> tuple[str, int] | None:
    kind, index = getattr(module, "layer_type", None), getattr(module, "layer_idx", None)
    return (kind, index) if isinstance(kind, str) and isinstance(index, int) else None


def tie_kv_sharing(groups: list[HeadGroup]) -> list[HeadGroup]:
    """`groups` with each store layer and the reuse layers reading its keys and values
    (the latest store layer of their type before them) replaced by one SharedKVGroup
    where the store layer stood. A reuse layer whose store layer is not among `groups`
    (left whole) or has other heads is refused."""
    readers = [g for g in groups if getattr(g.module, READS_KV, None) is True and not g.shared_kv]
    if not readers:
        return groups
    stores = {
        position: g
        for g in groups
        if getattr(g.module, STORES, None) is True and (position := _position(g.module))
    }
    chains: dict[nn.Module, list[HeadGroup]] = {}
    for reader in readers:
        position = _position(reader.module)
        earlier = [
            (index, g)
            for (kind, index), g in stores.items()
            if position is not None and kind == position[0] and index < position[1]
        ]
        if not earlier:
            reader.refusal = UNTIED
            continue
        store = max(earlier, key=lambda pair: pair[0])[1]
        if (store.units, store.query_heads_per_unit, store.head_dim) != (
            reader.units,
            reader.query_heads_per_unit,
            reader.head_dim,
        ):
            reader.refusal = (
                f"it reads the keys and values of {store.name!r}, whose heads are not its own"
            )
            continue
        chains.setdefault(store.module, [store]).append(reader)
    tied = {module: SharedKVGroup.of(chain, {}) for module, chain in chains.items()}
    later = {g.module for chain in chains.values() for g in chain[1:]}
    return [tied.get(g.module, g) for g in groups if g.module not in later]
