"""timm's EVA attention (EVA-02, DINOv3, Perception Encoder, RoPE-ViT) with some of its
heads removed.

timm's `EvaAttention` reshapes its heads' output to the width of its input, the model
width, so a layer that has lost heads no longer runs; its key bias (a buffer, always
zero) is of the query width too. Export gives such a layer :class:`PrunedEvaAttention`:
the same parameters and state-dict keys, a forward that reshapes the heads' output to
their own width and takes the key bias as zeros of the query bias's width.
"""

from __future__ import annotations

import torch
from timm.layers import apply_rot_embed_cat
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models.eva import EvaAttention
from torch import nn


class PrunedEvaAttention(EvaAttention):
    """timm's EvaAttention whose heads may be fewer than the model width over their size:
    what export makes of one that lost heads."""

    replaces = EvaAttention

    @classmethod
    def from_dense(cls, layer: EvaAttention) -> EvaAttention:
        """`layer` itself, given this class, without the key-bias buffer (a loader then
        gives it the saved shapes)."""
        layer.__class__ = cls
        if layer.q_bias is not None:
            layer.k_bias = None  # zeros, made in forward at the kept width
        return layer

    def _queries_keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(batch, heads, tokens, head size) each."""
        batch, tokens, _ = x.shape
        if self.qkv is None:
            projections = (self.q_proj, self.k_proj, self.v_proj)
            return tuple(
                p(x).reshape(batch, tokens, self.num_heads, -1).transpose(1, 2) for p in projections
            )
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            bias = torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))
            if self.qkv_bias_separate:
                qkv = self.qkv(x) + bias
            else:
                qkv = nn.functional.linear(x, self.qkv.weight, bias)
        return qkv.reshape(batch, tokens, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def _rotated(self, t: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """`t` with the rotary embedding applied to all but the prefix tokens."""
        prefix = self.num_prefix_tokens
        half = getattr(self, "rotate_half", False)
        rotated = apply_rot_embed_cat(t[:, :, prefix:, :], rope, half=half)
        return torch.cat([t[:, :, :prefix, :], rotated], dim=2)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        gate = None if self.gate is None else self.gate(x).sigmoid()
        q, k, v = self._queries_keys_values(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = self._rotated(q, rope).type_as(v), self._rotated(k, rope).type_as(v)
        if self.fused_attn:
            dropout = self.attn_drop.p if self.training else 0.0
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal
            )
        else:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            mask = resolve_self_attn_mask(tokens, scores, attn_mask, is_causal=is_causal)
            out = self.attn_drop(maybe_add_mask(scores, mask).softmax(dim=-1)) @ v
        out = self.norm(out.transpose(1, 2).reshape(batch, tokens, -1))  # the heads' width
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


PRUNED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {EvaAttention: PrunedEvaAttention}
