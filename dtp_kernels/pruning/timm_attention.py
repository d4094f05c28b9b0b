"""timm's attention layers that reshape their heads' output to the model width, with some
of their heads removed: EVA's (EVA-02, DINOv3, Perception Encoder, RoPE-ViT), BEiT's,
Swin V2's, DaViT's (its channel attention and its window attention), the cross-covariance
attention of XCiT and EdgeNeXt, VOLO's, the relative-position ViT's, NeXt-ViT's, the
class attention of CaiT and XCiT, PVT v2's and Twins' (keys and values from the tokens
sub-sampled; Twins' also within windows), Swin V2 CR's, NesT's, ConViT's, CaiT's
talking heads and FastViT's.

Their code reshapes the heads' output to the width of the layer's input (DaViT's, XCiT's,
EdgeNeXt's, VOLO's, Twins', NesT's, ConViT's and the class attention's also take the
head size to be that width over the heads), so a layer that has lost heads no longer
runs; their key bias, when the query and value have one, is a zero buffer of the query
width. Export gives such a layer the subclass below: the same parameters and state-dict
keys, a forward that reshapes the heads' output to their own width and makes the key
bias as zeros of the query bias's width (the buffer is dropped, so nothing of the dense
width is left).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from timm.layers import apply_rot_embed_cat
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models.beit import Attention as BeitAttention
from timm.models.cait import ClassAttn, TalkingHeadAttn
from timm.models.convit import GPSA, MHSA
from timm.models.davit import ChannelAttention as DavitChannelAttention
from timm.models.davit import WindowAttention as DavitWindowAttention
from timm.models.edgenext import CrossCovarianceAttn as EdgeNextAttention
from timm.models.eva import EvaAttention
from timm.models.fastvit import Attention as FastVitAttention
from timm.models.nest import Attention as NestAttention
from timm.models.nextvit import EfficientAttention as NextVitAttention
from timm.models.pvt_v2 import Attention as PvtV2Attention
from timm.models.swin_transformer_v2 import WindowAttention as SwinV2WindowAttention
from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention as SwinV2CrAttention
from timm.models.twins import GlobalSubSampleAttn as TwinsGlobalAttention
from timm.models.twins import LocallyGroupedAttn as TwinsLocalAttention
from timm.models.vision_transformer_relpos import RelPosAttention
from timm.models.volo import Attention as VoloAttention
from timm.models.xcit import XCA
from torch import nn

from .pruned_classes import GivenToTheLayer


class _GivenToTheLayer(GivenToTheLayer):
    """A class export gives the layer itself, without its zero key-bias buffer."""

    @classmethod
    def from_dense(cls, layer: nn.Module) -> nn.Module:
        """`layer` itself, given this class, without its zero key-bias buffer (a loader
        then gives it the saved shapes)."""
        layer = super().from_dense(layer)
        if getattr(layer, "q_bias", None) is not None:
            setattr(layer, "k_bias", None)  # noqa: B010 (zeros, made in forward at the kept width)
        return layer


def _heads(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values (batch, heads, tokens, head size) of the fused projection
    `layer.qkv`, with the query and value biases `layer.q_bias`, `layer.v_bias` (and a
    zero key bias) where the layer has them, added as its class adds them."""
    batch, tokens, _ = x.shape
    if getattr(layer, "q_bias", None) is None:  # DaViT's layers have none
        qkv = layer.qkv(x)
    else:
        bias = torch.cat((layer.q_bias, torch.zeros_like(layer.q_bias), layer.v_bias))
        if layer.qkv_bias_separate:
            qkv = layer.qkv(x) + bias
        else:
            qkv = nn.functional.linear(x, layer.qkv.weight, bias)
    return qkv.reshape(batch, tokens, 3, layer.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _attention(layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention with no mask as timm writes it: fused (the layer's dropout when training)
    or written out with the layer's scale and dropout."""
    if layer.fused_attn:
        dropout = layer.attn_drop.p if layer.training else 0.0
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
    return layer.attn_drop(((q * layer.scale) @ k.transpose(-2, -1)).softmax(dim=-1)) @ v


def _merged(out: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head size) -> (batch, tokens, heads * head size)."""
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


class PrunedEvaAttention(_GivenToTheLayer, EvaAttention):
    """timm's EvaAttention whose heads may be fewer than the model width over their size."""

    replaces = EvaAttention

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
        if self.qkv is None:
            projections = (self.q_proj, self.k_proj, self.v_proj)
            q, k, v = (
                p(x).reshape(batch, tokens, self.num_heads, -1).transpose(1, 2) for p in projections
            )
        else:
            q, k, v = _heads(self, x)
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
        out = self.norm(_merged(out))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


class PrunedBeitAttention(_GivenToTheLayer, BeitAttention):
    """timm's BEiT Attention whose heads may be fewer than the model width over their
    size (its relative position bias table cut with them)."""

    replaces = BeitAttention

    def forward(
        self, x: torch.Tensor, shared_rel_pos_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = _heads(self, x)
        table: torch.Tensor | None = None
        if self.relative_position_bias_table is not None:
            table = self._get_rel_pos_bias()
        if self.fused_attn:
            bias = table
            if shared_rel_pos_bias is not None:
                bias = shared_rel_pos_bias if bias is None else bias + shared_rel_pos_bias
            dropout = self.attn_drop.p if self.training else 0.0
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=dropout
            )
        else:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            for added in (table, shared_rel_pos_bias):  # added one after the other
                if added is not None:
                    scores = scores + added
            out = self.attn_drop(scores.softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(_merged(out)))


class PrunedSwinV2WindowAttention(_GivenToTheLayer, SwinV2WindowAttention):
    """timm's Swin V2 WindowAttention (cosine attention, a logit scale per head, a bias
    MLP with an output per head) whose heads may be fewer than the model width over
    their size."""

    replaces = SwinV2WindowAttention
    cpb_mlp: nn.Sequential  # (its bias MLP, and the buffers it reads)
    relative_coords_table: torch.Tensor
    relative_position_index: torch.Tensor

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        tokens = x.shape[1]
        q, k, v = _heads(self, x)
        q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
        scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        scores = (q @ k.transpose(-2, -1)) * scale
        area = self.window_size[0] * self.window_size[1]
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = table[self.relative_position_index.view(-1)].view(area, area, -1)
        scores = scores + 16 * torch.sigmoid(bias.permute(2, 0, 1).contiguous()).unsqueeze(0)
        if mask is not None:  # per window of the shifted map
            windows = mask.shape[0]
            scores = scores.view(-1, windows, self.num_heads, tokens, tokens) + mask[None, :, None]
            scores = scores.view(-1, self.num_heads, tokens, tokens)
        out = self.attn_drop(self.softmax(scores)) @ v
        return self.proj_drop(self.proj(_merged(out)))


class PrunedDavitChannelAttention(_GivenToTheLayer, DavitChannelAttention):
    """timm DaViT's ChannelAttention (each head attends over its own channels) whose heads
    may be fewer than the model width over their size."""

    replaces = DavitChannelAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _heads(self, x)
        attention = ((k * self.scale).transpose(-1, -2) @ v).softmax(dim=-1)
        return self.proj(_merged((attention @ q.transpose(-1, -2)).transpose(-1, -2)))


class PrunedDavitWindowAttention(_GivenToTheLayer, DavitWindowAttention):
    """timm DaViT's WindowAttention whose heads may be fewer than the model width over
    their size."""

    replaces = DavitWindowAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _heads(self, x)
        if self.fused_attn:
            out = nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            out = self.softmax((q * self.scale) @ k.transpose(-2, -1)) @ v
        return self.proj(_merged(out))


def _cross_covariance(layer: Any, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """XCiT's and EdgeNeXt's attention over each head's channels: queries and keys
    L2-normalised over the tokens, a learned temperature per head, the heads' output
    merged back to the tokens."""
    batch, tokens, _ = x.shape
    qkv = layer.qkv(x).reshape(batch, tokens, 3, layer.num_heads, -1)
    q, k, v = qkv.permute(2, 0, 3, 4, 1).unbind(0)  # (batch, heads, head size, tokens)
    q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
    if fused:
        out = nn.functional.scaled_dot_product_attention(q * layer.temperature, k, v, scale=1.0)
    else:
        out = layer.attn_drop(((q @ k.transpose(-2, -1)) * layer.temperature).softmax(dim=-1)) @ v
    return layer.proj_drop(layer.proj(out.permute(0, 3, 1, 2).reshape(batch, tokens, -1)))


class PrunedXcitAttention(_GivenToTheLayer, XCA):
    """timm XCiT's cross-covariance attention (XCA) whose heads may be fewer than the
    model width over their size (its temperature per head cut with them)."""

    replaces = XCA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _cross_covariance(self, x, self.fused_attn)


class PrunedEdgeNextAttention(_GivenToTheLayer, EdgeNextAttention):
    """timm EdgeNeXt's CrossCovarianceAttn whose heads may be fewer than the model width
    over their size (its temperature per head cut with them)."""

    replaces = EdgeNextAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _cross_covariance(self, x, False)


class PrunedVoloAttention(_GivenToTheLayer, VoloAttention):
    """timm VOLO's Attention (over an image of tokens) whose heads may be fewer than the
    model width over their size."""

    replaces = VoloAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, height, width, _ = x.shape
        qkv = self.qkv(x).reshape(batch, height * width, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = _attention(self, q, k, v)
        out = out.transpose(1, 2)
        return self.proj_drop(self.proj(out.reshape(batch, height, width, -1)))


class PrunedRelPosAttention(_GivenToTheLayer, RelPosAttention):
    """timm's relative-position ViT attention whose heads may be fewer than the model width
    over their size (its position-bias module's table or MLP rows cut with them)."""

    replaces = RelPosAttention
    rel_pos: Any  # timm's position-bias module (RelPosBias, RelPosMlp, ...) or None

    def forward(self, x: torch.Tensor, shared_rel_pos: torch.Tensor | None = None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            bias = self.rel_pos.get_bias() if self.rel_pos is not None else shared_rel_pos
            dropout = self.attn_drop.p if self.training else 0.0
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=dropout
            )
        else:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            if self.rel_pos is not None:
                scores = self.rel_pos(scores, shared_rel_pos=shared_rel_pos)
            elif shared_rel_pos is not None:
                scores = scores + shared_rel_pos
            out = self.attn_drop(scores.softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(_merged(out)))


class PrunedClassAttn(_GivenToTheLayer, ClassAttn):
    """timm's class attention (CaiT's and XCiT's: the class token's query over all tokens)
    whose heads may be fewer than the model width over their size."""

    replaces = ClassAttn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x[:, :1]).reshape(batch, 1, self.num_heads, -1).transpose(1, 2)
        k, v = (
            p(x).reshape(batch, tokens, self.num_heads, -1).transpose(1, 2)
            for p in (self.k, self.v)
        )
        out = _attention(self, q, k, v)
        return self.proj_drop(self.proj(_merged(out)))


class PrunedNextVitAttention(_GivenToTheLayer, NextVitAttention):
    """timm NeXt-ViT's EfficientAttention (keys and values from the tokens pooled and
    normalized) whose heads may be fewer than the model width over their size."""

    replaces = NextVitAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).reshape(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        if self.sr is not None:
            x = self.norm(self.sr(x.transpose(1, 2))).transpose(1, 2)
        k, v = (
            p(x).reshape(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.k, self.v)
        )
        out = _attention(self, q, k, v)
        return self.proj_drop(self.proj(_merged(out)))


def _sub_sampled_keys_values(
    layer: Any, x: torch.Tensor, size: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (batch, heads, tokens, head size) of `layer.kv` over the tokens `x`
    of an image of `size`, first pooled (PVT v2's linear attention), reduced by the strided
    convolution `layer.sr`, normalized and activated where the layer has these (PVT v2's
    and Twins' sub-sampled attention)."""
    batch, _, channels = x.shape
    pool, act = getattr(layer, "pool", None), getattr(layer, "act", None)
    if layer.sr is not None:
        x = x.transpose(1, 2).reshape(batch, channels, *size)
        x = layer.sr(x if pool is None else pool(x))
        x = layer.norm(x.reshape(batch, x.shape[1], -1).transpose(1, 2))
        x = x if act is None else act(x)
    kv = layer.kv(x).reshape(batch, x.shape[1], 2, layer.num_heads, -1)
    return kv.permute(2, 0, 3, 1, 4).unbind(0)


class PrunedPvtV2Attention(_GivenToTheLayer, PvtV2Attention):
    """timm PVT v2's attention (keys and values from the tokens sub-sampled) whose heads
    may be fewer than the model width over their size."""

    replaces = PvtV2Attention

    def forward(self, x: torch.Tensor, feat_size: list[int]) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).reshape(batch, tokens, self.num_heads, -1).transpose(1, 2)
        k, v = _sub_sampled_keys_values(self, x, feat_size)
        return self.proj_drop(self.proj(_merged(_attention(self, q, k, v))))


class PrunedTwinsGlobalAttention(_GivenToTheLayer, TwinsGlobalAttention):
    """timm Twins' global sub-sampled attention whose heads may be fewer than the model
    width over their size."""

    replaces = TwinsGlobalAttention

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).reshape(batch, tokens, self.num_heads, -1).transpose(1, 2)
        k, v = _sub_sampled_keys_values(self, x, size)
        return self.proj_drop(self.proj(_merged(_attention(self, q, k, v))))


class PrunedTwinsLocalAttention(_GivenToTheLayer, TwinsLocalAttention):
    """timm Twins' attention within windows of `ws` x `ws` tokens whose heads may be
    fewer than the model width over their size."""

    replaces = TwinsLocalAttention

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        batch, tokens, channels = x.shape
        height, width = size
        ws = self.ws
        pad_right, pad_bottom = (ws - width % ws) % ws, (ws - height % ws) % ws
        x = nn.functional.pad(
            x.view(batch, height, width, channels), (0, 0, 0, pad_right, 0, pad_bottom)
        )
        rows, cols = x.shape[1] // ws, x.shape[2] // ws
        x = x.reshape(batch, rows, ws, cols, ws, channels).transpose(2, 3)
        qkv = self.qkv(x).reshape(batch, rows * cols, ws * ws, 3, self.num_heads, -1)
        q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).unbind(0)
        out = _attention(self, q, k, v)  # (batch, windows, heads, ws * ws, head size)
        out = out.transpose(2, 3).reshape(batch, rows, cols, ws, ws, -1)
        out = out.transpose(2, 3).reshape(batch, rows * ws, cols * ws, -1)
        if pad_right > 0 or pad_bottom > 0:
            out = out[:, :height, :width, :].contiguous()
        return self.proj_drop(self.proj(out.reshape(batch, tokens, -1)))


class PrunedSwinV2CrAttention(_GivenToTheLayer, SwinV2CrAttention):
    """timm Swin V2 CR's window attention (scaled cosine attention, a position bias per
    head from its meta MLP) whose heads may be fewer than the model width over their
    size."""

    replaces = SwinV2CrAttention

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        windows, tokens, _ = x.shape
        qkv = self.qkv(x).view(windows, tokens, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).mT
        scale = self.logit_scale.reshape(1, self.num_heads, 1, 1)
        scores = scores * torch.clamp(scale, max=math.log(1.0 / 0.01)).exp()
        scores = scores + self._relative_positional_encodings()
        if mask is not None:
            count = mask.shape[0]
            scores = scores.view(windows // count, count, self.num_heads, tokens, tokens)
            scores = scores + mask.unsqueeze(1).unsqueeze(0)
            scores = scores.view(-1, self.num_heads, tokens, tokens)
        out = self.attn_drop(scores.softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(_merged(out)))


class PrunedNestAttention(_GivenToTheLayer, NestAttention):
    """timm NesT's attention within image blocks whose heads may be fewer than the model
    width over their size. Its code merges the heads' outputs with the head innermost
    (channel c of head h at c * heads + h), which `heads_innermost` tells the pruner."""

    replaces = NestAttention
    heads_innermost = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, blocks, tokens, _ = x.shape
        qkv = self.qkv(x).reshape(batch, blocks, tokens, 3, self.num_heads, -1)
        q, k, v = qkv.permute(3, 0, 4, 1, 2, 5).unbind(0)
        out = _attention(self, q, k, v)  # (batch, heads, blocks, tokens, head size)
        out = out.permute(0, 2, 3, 4, 1).reshape(batch, blocks, tokens, -1)
        return self.proj_drop(self.proj(out))


class PrunedConvitGatedAttention(_GivenToTheLayer, GPSA):
    """timm ConViT's gated positional self-attention (each head's patch attention mixed
    with its positional attention by its gate) whose heads may be fewer than the model
    width over their size."""

    replaces = GPSA
    # its relative positions, a buffer not saved that forward makes for its token count:
    # a model loaded from its builder (a placeholder there) remakes them
    remade_buffers = ("rel_indices",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        if self.rel_indices is None or self.rel_indices.shape[1] != tokens:
            self.rel_indices = self.get_rel_indices(tokens)
        attn = self.get_attention(x)
        v = self.v(x).reshape(batch, tokens, self.num_heads, -1).transpose(1, 2)
        return self.proj_drop(self.proj(_merged(attn @ v)))

    def get_attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k = self.qk(x).reshape(batch, tokens, 2, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        positions = self.pos_proj(self.rel_indices.expand(batch, -1, -1, -1)).permute(0, 3, 1, 2)
        patches = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        gate = self.gating_param.view(1, -1, 1, 1)  # its sigmoid made twice, as timm's
        attn = (1.0 - torch.sigmoid(gate)) * patches + torch.sigmoid(gate) * positions.softmax(-1)
        attn /= attn.sum(dim=-1).unsqueeze(-1)
        return self.attn_drop(attn)


class PrunedConvitAttention(_GivenToTheLayer, MHSA):
    """timm ConViT's self-attention whose heads may be fewer than the model width over
    their size."""

    replaces = MHSA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = self.attn_drop(((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1))
        return self.proj_drop(self.proj(_merged(attn @ v)))


class PrunedTalkingHeadAttn(_GivenToTheLayer, TalkingHeadAttn):
    """timm CaiT's talking-heads attention (its heads' logits and weights mixed by
    `proj_l` and `proj_w`, cut with the heads) whose heads may be fewer than the model
    width over their size."""

    replaces = TalkingHeadAttn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = self.proj_l((q @ k.transpose(-2, -1)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        attn = self.proj_w(attn.softmax(dim=-1).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        out = self.attn_drop(attn) @ v
        return self.proj_drop(self.proj(_merged(out)))


class PrunedFastVitAttention(_GivenToTheLayer, FastVitAttention):
    """timm FastViT's attention (over an image's positions, channels first) whose heads
    may be fewer than the model width over their size."""

    replaces = FastVitAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        q, k, v = _heads(self, x.flatten(2).transpose(-2, -1))
        out = self.proj_drop(self.proj(_merged(_attention(self, q, k, v))))
        return out.transpose(-2, -1).reshape(batch, -1, height, width)


PRUNED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    EvaAttention: PrunedEvaAttention,
    BeitAttention: PrunedBeitAttention,
    SwinV2WindowAttention: PrunedSwinV2WindowAttention,
    DavitChannelAttention: PrunedDavitChannelAttention,
    DavitWindowAttention: PrunedDavitWindowAttention,
    XCA: PrunedXcitAttention,
    EdgeNextAttention: PrunedEdgeNextAttention,
    VoloAttention: PrunedVoloAttention,
    RelPosAttention: PrunedRelPosAttention,
    ClassAttn: PrunedClassAttn,
    TalkingHeadAttn: PrunedTalkingHeadAttn,
    NextVitAttention: PrunedNextVitAttention,
    PvtV2Attention: PrunedPvtV2Attention,
    TwinsGlobalAttention: PrunedTwinsGlobalAttention,
    TwinsLocalAttention: PrunedTwinsLocalAttention,
    SwinV2CrAttention: PrunedSwinV2CrAttention,
    NestAttention: PrunedNestAttention,
    GPSA: PrunedConvitGatedAttention,
    MHSA: PrunedConvitAttention,
    FastVitAttention: PrunedFastVitAttention,
}
