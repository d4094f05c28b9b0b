"""Hugging Face attention layers that reshape their heads' output to the model width, with
some of their heads removed: TrOCR's (its decoder's self- and cross-attention), PVT
v2's, TimeSformer's (over space and over time), and the DETR-style attention that adds
position embeddings to its queries and keys (Table Transformer's; Mask2Former's and
OneFormer's, sequence first); and Wav2Vec2-Conformer's, whose rotary embedding splits
the layer's input into as many chunks as the layer has heads.

Their code reshapes the heads' output (or the input) to the width of the layer's input
by its head count, so a layer that has lost heads no longer runs. Export gives such a
layer the subclass below: the same parameters, state-dict keys, call and outputs
(TrOCR's key/value cache included), a forward that reshapes by the heads' own width.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.models.dab_detr.modeling_dab_detr import DetrAttention as DabDetrEncoderAttention
from transformers.models.mask2former.modeling_mask2former import Mask2FormerAttention
from transformers.models.oneformer.modeling_oneformer import OneFormerAttention
from transformers.models.pvt_v2.modeling_pvt_v2 import PvtV2SelfAttention
from transformers.models.table_transformer.modeling_table_transformer import (
    TableTransformerAttention,
)
from transformers.models.timesformer.modeling_timesformer import TimesformerSelfAttention
from transformers.models.trocr.modeling_trocr import TrOCRAttention
from transformers.models.wav2vec2_conformer.modeling_wav2vec2_conformer import (
    Wav2Vec2ConformerSelfAttention,
)

from .pruned_classes import GivenToTheLayer


class PrunedTrOCRAttention(GivenToTheLayer, TrOCRAttention):
    """TrOCR's attention whose heads may be fewer than the model width over their size."""

    replaces = TrOCRAttention

    def _keys_and_values(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None,
        cache,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (batch, heads, tokens, head size): projected from the source
        (the encoder's states for cross-attention), added to the cache, or read from it
        where a cross-attention layer already wrote its own."""
        cross = key_value_states is not None
        index = cast(int, self.layer_idx)  # (transformers annotates it `bool | None`)
        layer_cache, written = cache, False
        if isinstance(cache, EncoderDecoderCache):
            written = bool(cache.is_updated.get(index))
            layer_cache = cache.cross_attention_cache if cross else cache.self_attention_cache
        if cross and cache is not None and written:
            layer = layer_cache.layers[index]
            return layer.keys, layer.values
        source = hidden_states if key_value_states is None else key_value_states
        batch = source.shape[0]
        key, value = (
            p(source).view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.k_proj, self.v_proj)
        )
        if cache is not None:
            key, value = layer_cache.update(key, value, index, kwargs=kwargs)
            if cross and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[index] = True
        return key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        heads = batch * self.num_heads
        query = self.q_proj(hidden_states) * self.scaling
        key, value = self._keys_and_values(hidden_states, key_value_states, cache, kwargs)
        query = query.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        query, key, value = (t.reshape(heads, -1, self.head_dim) for t in (query, key, value))
        weights = torch.bmm(query, key.transpose(1, 2))
        sources = weights.shape[-1]
        if attention_mask is not None:
            weights = weights.view(batch, self.num_heads, length, sources) + attention_mask
            weights = weights.view(heads, length, sources)
        weights = nn.functional.softmax(weights, dim=-1)
        per_head = None
        if output_attentions:  # reshaped twice, as TrOCR's, so they keep their gradient
            per_head = weights.view(batch, self.num_heads, length, sources)
            weights = per_head.view(heads, length, sources)
        dropout = cast(float, self.dropout)  # (transformers annotates it `float | None`)
        probs = nn.functional.dropout(weights, p=dropout, training=self.training)
        out = torch.bmm(probs, value).view(batch, self.num_heads, length, self.head_dim)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1)), per_head


class PrunedPvtV2SelfAttention(GivenToTheLayer, PvtV2SelfAttention):
    """PVT v2's attention (keys and values from the tokens sub-sampled) whose heads may be
    fewer than the model width over their size."""

    replaces = PvtV2SelfAttention

    # (one item or two, as transformers' forward returns: it is annotated one)
    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        height: int,
        width: int,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        batch, tokens, channels = hidden_states.shape
        query = self.transpose_for_scores(self.query(hidden_states))
        if self.linear_attention or self.spatial_reduction_ratio > 1:
            image = hidden_states.transpose(1, 2).reshape(batch, channels, height, width)
            reduced = self.spatial_reduction(self.pool(image) if self.linear_attention else image)
            hidden_states = self.layer_norm(reduced.reshape(batch, channels, -1).transpose(1, 2))
            if self.linear_attention:
                hidden_states = self.act(hidden_states)
        key = self.transpose_for_scores(self.key(hidden_states))
        value = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        probs = self.attn_drop(nn.functional.softmax(scores, dim=-1))
        context = (probs @ value).transpose(1, 2).reshape(batch, tokens, -1)
        context = self.proj_drop(self.proj(context))
        return (context, probs) if output_attentions else (context,)


def _with(states: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    return states if positions is None else states + positions


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: not attended) as the bias it stands for; any other as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -torch.inf)


class _PositionedAttention(GivenToTheLayer):
    """DETR's attention as Table Transformer, Mask2Former and OneFormer keep it: queries
    and keys from the states with their position embeddings added, values from the states
    alone; the heads' output reshaped to their own width."""

    # the attention layer's, which this class is mixed into
    num_heads: int
    head_dim: int
    scaling: float
    dropout: float
    training: bool
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    out_proj: nn.Linear

    def _dropout(self) -> float:
        """The attention weights' dropout probability."""
        return self.dropout

    def _attend(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, attention weights per head) for batch-first inputs; `bias` is added to
        the (batch, heads, queries, keys) scores."""
        batch, length, heads = queries.shape[0], queries.shape[1], self.num_heads

        def split(x: torch.Tensor) -> torch.Tensor:  # (batch * heads, tokens, head size)
            x = x.view(batch, -1, heads, self.head_dim).transpose(1, 2)
            return x.reshape(batch * heads, -1, self.head_dim)

        query = split(self.q_proj(queries) * self.scaling)
        key, value = split(self.k_proj(keys)), split(self.v_proj(values))
        scores = torch.bmm(query, key.transpose(1, 2))
        sources = scores.shape[-1]
        if bias is not None:
            scores = (scores.view(batch, heads, length, sources) + bias).view(scores.shape)
        weights = nn.functional.softmax(scores, dim=-1)
        probs = nn.functional.dropout(weights, p=self._dropout(), training=self.training)
        out = torch.bmm(probs, value).view(batch, heads, length, self.head_dim)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))
        return out, weights.view(batch, heads, length, sources)

    def _positioned(
        self,
        states: torch.Tensor,
        positions: torch.Tensor | None,
        sources: torch.Tensor | None,
        source_positions: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_attend` over `sources` (cross-attention) or `states` (self-attention): the
        queries and keys with their position embeddings added, the values without."""
        queries = _with(states, positions)
        if sources is None:
            return self._attend(queries, queries, states, bias)
        return self._attend(queries, _with(sources, source_positions), sources, bias)


class PrunedTableTransformerAttention(_PositionedAttention, TableTransformerAttention):
    """Table Transformer's attention whose heads may be fewer than the model width over
    their size."""

    replaces = TableTransformerAttention

    # (two items, as transformers' forward returns: it is annotated three)
    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        object_queries: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        spatial_position_embeddings: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = _additive(attention_mask, hidden_states.dtype)  # (batch, 1, queries, keys)
        out, weights = self._positioned(
            hidden_states, object_queries, key_value_states, spatial_position_embeddings, bias
        )
        return out, (weights if output_attentions else None)


class PrunedDabDetrEncoderAttention(_PositionedAttention, DabDetrEncoderAttention):
    """DAB-DETR's encoder attention (DETR's older code, which reshapes the heads' output
    to the input width) whose heads may be fewer than the model width over their size."""

    replaces = DabDetrEncoderAttention

    def _dropout(self) -> float:
        return self.attention_dropout

    # (two items, as transformers' forward returns: it is annotated three)
    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        object_queries: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # self-attention only: the original reads no key_value_states either
        bias = _additive(attention_mask, hidden_states.dtype)
        out, weights = self._positioned(hidden_states, object_queries, None, None, bias)
        return out, (weights if output_attentions else None)


class _SequenceFirstAttention(_PositionedAttention):
    """Mask2Former's and OneFormer's form: (tokens, batch, width) in and out, a mask of
    one (queries, keys) slice per batch item and head."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        key_value_position_embeddings: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        def first(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.transpose(0, 1)

        bias = attention_mask
        if bias is not None:  # (batch * heads, queries, keys)
            bias = bias.view(hidden_states.shape[1], self.num_heads, *bias.shape[1:])
        out, weights = self._positioned(
            hidden_states.transpose(0, 1),
            first(position_embeddings),
            first(key_value_states),
            first(key_value_position_embeddings),
            bias,
        )
        return out.transpose(0, 1), (weights if output_attentions else None)


# (its forward returns two items, as transformers' do: they are annotated three)
class PrunedMask2FormerAttention(_SequenceFirstAttention, Mask2FormerAttention):  # type: ignore[misc]
    """Mask2Former's attention whose heads may be fewer than the model width over their
    size."""

    replaces = Mask2FormerAttention


class PrunedOneFormerAttention(_SequenceFirstAttention, OneFormerAttention):  # type: ignore[misc]
    """OneFormer's attention whose heads may be fewer than the model width over their
    size."""

    replaces = OneFormerAttention


class PrunedTimesformerSelfAttention(GivenToTheLayer, TimesformerSelfAttention):
    """TimeSformer's attention (over space or over time) whose heads may be fewer than
    the model width over their size."""

    replaces = TimesformerSelfAttention

    def forward(
        self, hidden_states: torch.Tensor, output_attentions: bool = False
    ) -> tuple[torch.Tensor, ...]:
        batch, tokens, _ = hidden_states.shape
        head_dim = self.qkv.out_features // (3 * self.num_heads)
        qkv = self.qkv(hidden_states).reshape(batch, tokens, 3, self.num_heads, head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)
        probs = ((query @ key.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        probs = self.attn_drop(probs)
        context = (probs @ value).transpose(1, 2).reshape(batch, tokens, -1)
        return (context, probs) if output_attentions else (context,)


class PrunedWav2Vec2ConformerSelfAttention(GivenToTheLayer, Wav2Vec2ConformerSelfAttention):
    """Wav2Vec2-Conformer's attention whose heads may be fewer than the model width over
    their size: its rotary embedding turns each head-sized chunk of the layer's input,
    however many heads the layer keeps (the input keeps the model width)."""

    replaces = Wav2Vec2ConformerSelfAttention

    def _apply_rotary_embedding(
        self, hidden_states: torch.Tensor, relative_position_embeddings: torch.Tensor
    ) -> torch.Tensor:
        batch, length, width = hidden_states.shape
        chunks = hidden_states.view(batch, length, width // self.head_size, self.head_size)
        cos, sin = relative_position_embeddings[:, :length, 0]  # (length, 1, head size) each
        half = self.head_size // 2
        turned = torch.cat((-chunks[..., half:], chunks[..., :half]), dim=-1)
        return (chunks * cos + turned * sin).reshape(batch, length, width)


PRUNED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    TrOCRAttention: PrunedTrOCRAttention,
    PvtV2SelfAttention: PrunedPvtV2SelfAttention,
    TableTransformerAttention: PrunedTableTransformerAttention,
    Mask2FormerAttention: PrunedMask2FormerAttention,
    OneFormerAttention: PrunedOneFormerAttention,
    TimesformerSelfAttention: PrunedTimesformerSelfAttention,
    DabDetrEncoderAttention: PrunedDabDetrEncoderAttention,
    Wav2Vec2ConformerSelfAttention: PrunedWav2Vec2ConformerSelfAttention,
}
