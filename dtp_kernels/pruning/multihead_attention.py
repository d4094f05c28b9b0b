"""What a pruned ``nn.MultiheadAttention`` exports to: its computation with fewer heads,
whose inner width need not equal the embedding width torch ties it to, and which picks
its heads' masks from a mask per head made for all the layer's heads (Mask2Former's
decoder makes one for its cross-attention)."""

from __future__ import annotations

import torch
from torch import nn


class PrunedMultiheadAttention(nn.Module):
    """nn.MultiheadAttention's computation with `num_heads` heads of `head_dim` whose
    inner width (num_heads * head_dim) need not equal `embed_dim`: what a pruned
    nn.MultiheadAttention exports to. Same forward signature and outputs. The buffer
    `kept_heads` holds the source's heads it computes, in order: an `attn_mask` per head
    (batch * heads, L, S) made for more heads than it has gives it theirs."""

    replaces = nn.MultiheadAttention
    kept_heads: torch.Tensor
    # read by torch's nn.TransformerEncoderLayer before it takes its fused fast path,
    # which computes nn.MultiheadAttention's own width: False sends it to this forward
    _qkv_same_embed_dim = False

    def __init__(
        self,
        source: nn.MultiheadAttention,
        kept_rows: torch.Tensor,
        kept_heads: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim, self.head_dim = source.embed_dim, source.head_dim
        self.num_heads = len(kept_rows) // (3 * source.head_dim)
        kept_heads = torch.arange(self.num_heads) if kept_heads is None else kept_heads
        self.register_buffer("kept_heads", kept_heads.to(source.in_proj_weight.device))
        self.batch_first, self.dropout = source.batch_first, source.dropout
        rows = kept_rows.to(source.in_proj_weight.device)
        self.in_proj_weight = nn.Parameter(source.in_proj_weight.detach()[rows].clone())
        bias = source.in_proj_bias
        self.in_proj_bias = None if bias is None else nn.Parameter(bias.detach()[rows].clone())
        self.out_proj = source.out_proj  # its columns are cut by the caller

    @classmethod
    def from_dense(cls, source: nn.MultiheadAttention) -> PrunedMultiheadAttention:
        """One with every head of `source` (a loader then gives it the saved shapes)."""
        return cls(source, torch.arange(source.in_proj_weight.shape[0]))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # files saved before `kept_heads` existed hold none: their layers were never
        # handed a mask per head (refused then), so their first heads stand for them
        if prefix + "kept_heads" not in state_dict:
            self.kept_heads = torch.arange(self.num_heads, device=self.kept_heads.device)
            state_dict[prefix + "kept_heads"] = self.kept_heads
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.is_nested:
            return self._ragged(query, key, value, attn_mask, is_causal), None
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # torch's own rule: the hint stands for the mask it is given
        batched = query.dim() == 3
        if not batched:
            query, key, value = (
                t.unsqueeze(0 if self.batch_first else 1) for t in (query, key, value)
            )
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, length, source = query.shape[0], query.shape[1], key.shape[1]
        inner = self.num_heads * self.head_dim
        w, b = self.in_proj_weight, self.in_proj_bias
        parts = [
            nn.functional.linear(
                x,
                w[i * inner : (i + 1) * inner],
                None if b is None else b[i * inner : (i + 1) * inner],
            )
            for i, x in enumerate((query, key, value))
        ]
        q, k, v = (p.view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2) for p in parts)
        if (
            attn_mask is not None
            and attn_mask.dim() == 3
            and len(attn_mask) != batch * self.num_heads
        ):
            # a mask per head made for all the source's heads: its kept heads' ones
            per_head = attn_mask.view(batch, -1, *attn_mask.shape[1:])
            attn_mask = per_head.index_select(1, self.kept_heads).flatten(0, 1)
        mask = _additive_mask(
            attn_mask, key_padding_mask, batch, self.num_heads, length, source, q.dtype
        )
        if is_causal and mask is None:  # a key after the query is never attended to
            causal = torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1)
            mask = _additive_mask(causal, None, batch, self.num_heads, length, source, q.dtype)
        scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        attention = scores.softmax(dim=-1)
        weights = attention
        if self.training and self.dropout > 0:
            attention = nn.functional.dropout(attention, self.dropout)
        out = (attention @ v).transpose(1, 2).reshape(batch, length, inner)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(0 if self.batch_first else 1)
        if not need_weights:
            return out, None
        weights = weights.mean(dim=1) if average_attn_weights else weights
        return out, (weights if batched else weights.squeeze(0))

    def _ragged(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        """The attention of nested (ragged) sequences, batch first, as torch's
        nn.TransformerEncoder hands them to its layers in eval with a padding mask:
        computed padded, the padding masked out as keys, the outputs ragged again."""
        if not self.batch_first:
            raise ValueError("nested inputs need batch_first=True (as nn.MultiheadAttention)")
        queries = [len(t) for t in query.unbind()]
        keys = torch.tensor([len(t) for t in key.unbind()], device=key.device)
        q, k, v = (t.to_padded_tensor(0.0) for t in (query, key, value))
        padding = torch.arange(k.shape[1], device=key.device)[None, :] >= keys[:, None]
        out, _ = self.forward(
            q,
            k,
            v,
            key_padding_mask=padding,
            need_weights=False,
            attn_mask=attn_mask,
            is_causal=is_causal,
        )
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, queries, strict=True)])


def _additive_mask(attn_mask, key_padding_mask, batch, heads, length, source, dtype):
    """nn.MultiheadAttention's attn_mask ((L, S) or (B * heads, L, S), bool or float) and
    key_padding_mask ((B, S), bool or float) as one additive (B, heads, L, S) mask."""
    total = None
    for mask, shape in ((attn_mask, None), (key_padding_mask, (batch, 1, 1, source))):
        if mask is None:
            continue
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                mask, float("-inf")
            )
        mask = mask.to(dtype)
        if shape is not None:
            mask = mask.view(shape)
        elif mask.dim() == 3:
            mask = mask.view(batch, heads, length, source)
        total = mask if total is None else total + mask
    return total
