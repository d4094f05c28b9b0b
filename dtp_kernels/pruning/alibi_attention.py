"""Hugging Face attention layers handed ALiBi biases for all the model's heads (BLOOM's,
MPT's, Falcon's when built with ALiBi), with some of their heads removed: each adds its
kept heads' own entries of the bias the model hands it (picked_heads.py). Same
parameters, call and outputs; the state dict gains `kept_heads`."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.bloom.modeling_bloom import BloomAttention
from transformers.models.falcon.modeling_falcon import FalconAttention
from transformers.models.mpt.modeling_mpt import MptAttention

from .picked_heads import PicksItsHeads


class PrunedBloomAttention(PicksItsHeads, BloomAttention):
    """BLOOM's attention adding its kept heads' entries of the model's ALiBi bias,
    (batch * the model's heads, 1, keys)."""

    replaces = BloomAttention
    picked, head_count = "alibi", "num_heads"

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        alibi: torch.Tensor,
        *args,
        **kwargs,
    ):
        batch = hidden_states.shape[0]
        per_head = alibi.view(batch, -1, *alibi.shape[1:])
        alibi = per_head.index_select(1, self.kept_heads).flatten(0, 1)
        return super().forward(hidden_states, residual, alibi, *args, **kwargs)


class PrunedMptAttention(PicksItsHeads, MptAttention):
    """MPT's attention adding its kept heads' entries of the model's ALiBi bias, (the
    model's heads, 1, keys)."""

    replaces = MptAttention
    picked, head_count = "position_bias", "n_heads"

    def forward(
        self, hidden_states: torch.Tensor, position_bias: torch.Tensor | None, *args, **kwargs
    ):
        if position_bias is not None:
            position_bias = position_bias.index_select(0, self.kept_heads)
        return super().forward(hidden_states, position_bias, *args, **kwargs)


class PrunedFalconAttention(PicksItsHeads, FalconAttention):
    """Falcon's attention, built with ALiBi, adding its kept heads' entries of the
    model's bias ((batch * the model's heads, 1, keys), or (batch, heads, 1, keys)) and
    of the attention mask the model adds it to ((batch, heads, queries, keys))."""

    replaces = FalconAttention
    picked, head_count = "alibi", "num_heads"

    @classmethod
    def picks(cls, layer: nn.Module) -> bool:
        return bool(getattr(layer.config, "alibi", False))

    def forward(
        self,
        hidden_states: torch.Tensor,
        alibi: torch.Tensor | None,
        attention_mask: torch.Tensor,
        *args,
        **kwargs,
    ):
        if alibi is not None:
            per_head = alibi.reshape(hidden_states.shape[0], -1, alibi.shape[-1])
            heads = per_head.shape[1]  # the model's
            alibi = per_head.index_select(1, self.kept_heads)
            mask = attention_mask
            # (Falcon's own forward takes a mask; a None passed all the same stays None)
            if mask is not None and mask.dim() == 4 and mask.shape[1] == heads:  # bias added in
                attention_mask = mask.index_select(1, self.kept_heads)
        return super().forward(hidden_states, alibi, attention_mask, *args, **kwargs)


PRUNED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    BloomAttention: PrunedBloomAttention,
    MptAttention: PrunedMptAttention,
    FalconAttention: PrunedFalconAttention,
}
