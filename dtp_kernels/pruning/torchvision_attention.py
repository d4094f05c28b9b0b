"""torchvision's attention layers that tie their heads to the model width, with some of
their heads removed: Swin's and Swin V2's shifted-window attention, Video Swin's (3-D
windows), MaxViT's.

torchvision computes a window attention layer's heads in one function that takes the head
size to be the layer's input width over its head count and reshapes the heads' output to
the input width; MaxViT's attention reshapes its heads' output to the input width too. So
a layer that has lost heads no longer runs. Export gives such a layer one of the classes
below: a subclass with the same parameters, buffers and state-dict keys whose forward is
the same computation with the head size taken from the projection
(:func:`window_attention` for Swin's, :func:`window_attention_3d` for Video Swin's) and
the output at the heads' own width.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchvision.models.maxvit import RelativePositionalMultiHeadAttention
from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2
from torchvision.models.video.swin_transformer import (
    ShiftedWindowAttention3d,
    _compute_attention_mask_3d,
    _compute_pad_size_3d,
    _get_window_and_shift_size,
)

from .pruned_classes import GivenToTheLayer

# the bias a shifted window adds between tokens from different regions of the image
OTHER_REGION = -100.0


def window_attention(
    x: torch.Tensor,
    layer: ShiftedWindowAttention,
    logit_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`layer`'s window attention of `x` (batch, height, width, channels) with
    `layer.num_heads` heads of any size: windows of `layer.window_size`, cyclically
    shifted by `layer.shift_size` (not along a side no longer than one window), the
    feature map zero-padded to whole windows and cropped back; cosine attention scaled by
    `logit_scale` per head (Swin V2, whose keys have no bias) when it is given."""
    batch, height, width, channels = x.shape
    window_h, window_w = layer.window_size
    x = nn.functional.pad(x, (0, 0, 0, -width % window_w, 0, -height % window_h))
    padded_h, padded_w = x.shape[1:3]
    # no shift along a side that one window covers
    shift = [0 if layer.window_size[i] >= x.shape[1 + i] else layer.shift_size[i] for i in (0, 1)]
    if any(shift):
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    rows, cols, tokens = padded_h // window_h, padded_w // window_w, window_h * window_w
    windows = x.view(batch, rows, window_h, cols, window_w, channels)
    windows = windows.permute(0, 1, 3, 2, 4, 5).reshape(batch * rows * cols, tokens, channels)

    bias = layer.qkv.bias
    if logit_scale is not None and bias is not None:  # Swin V2's keys have no bias
        bias = bias.clone()
        third = bias.numel() // 3
        bias[third : 2 * third].zero_()
    heads = layer.num_heads
    qkv = nn.functional.linear(windows, layer.qkv.weight, bias)
    head_dim = qkv.shape[-1] // (3 * heads)
    q, k, v = qkv.reshape(len(windows), tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    if logit_scale is not None:
        q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
        scores = q @ k.transpose(-2, -1)
        scores = scores * torch.clamp(logit_scale, max=math.log(100.0)).exp()
    else:
        scores = (q * head_dim**-0.5) @ k.transpose(-2, -1)
    scores = scores + layer.get_relative_position_bias()
    if any(shift):
        mask = _region_mask(padded_h, padded_w, layer.window_size, shift, scores)
        scores = scores.view(batch, rows * cols, heads, tokens, tokens) + mask[None, :, None]
        scores = scores.view(-1, heads, tokens, tokens)
    attention = scores.softmax(dim=-1)
    attention = nn.functional.dropout(attention, p=layer.attention_dropout, training=layer.training)

    out = (attention @ v).transpose(1, 2).reshape(len(windows), tokens, heads * head_dim)
    out = nn.functional.dropout(layer.proj(out), p=layer.dropout, training=layer.training)
    out = out.view(batch, rows, cols, window_h, window_w, channels)
    out = out.permute(0, 1, 3, 2, 4, 5).reshape(batch, padded_h, padded_w, channels)
    if any(shift):
        out = torch.roll(out, shifts=(shift[0], shift[1]), dims=(1, 2))
    return out[:, :height, :width, :].contiguous()


def _region_mask(
    height: int, width: int, window: list[int], shift: list[int], like: torch.Tensor
) -> torch.Tensor:
    """(windows, tokens, tokens): 0 between tokens of one region of the shifted map,
    OTHER_REGION between tokens of two. The cyclic shift brings the map's last `shift`
    rows (columns) next to the first, so along each side the regions are: before the
    last window, the last window up to the wrapped part, the wrapped part (none along a
    side not shifted)."""

    def region(side: int, size: int, moved: int) -> torch.Tensor:
        index = torch.arange(side, device=like.device)
        return (index >= side - size).long() + (index >= side - moved).long()

    labels = region(height, window[0], shift[0])[:, None] * 3 + region(width, window[1], shift[1])
    labels = labels.view(height // window[0], window[0], width // window[1], window[1])
    labels = labels.permute(0, 2, 1, 3).reshape(-1, window[0] * window[1])
    different = labels[:, None, :] != labels[:, :, None]
    return torch.zeros(different.shape, dtype=like.dtype, device=like.device).masked_fill(
        different, OTHER_REGION
    )


def window_attention_3d(x: torch.Tensor, layer: ShiftedWindowAttention3d) -> torch.Tensor:
    """Video Swin's window attention of `x` (batch, frames, height, width, channels) with
    `layer.num_heads` heads of any size: 3-D windows of `layer.window_size` (no larger
    than the map), cyclically shifted by `layer.shift_size` (none along a side one
    window covers), the map zero-padded to whole windows and cropped back; torchvision's
    computation, the head size taken from the projection."""
    batch, frames, height, width, channels = x.shape
    window, shift = _get_window_and_shift_size(
        layer.shift_size.copy(), [frames, height, width], layer.window_size.copy()
    )
    bias = layer.get_relative_position_bias(window)
    pad = _compute_pad_size_3d((frames, height, width), tuple(window))
    x = nn.functional.pad(x, (0, 0, 0, pad[2], 0, pad[1], 0, pad[0]))
    padded = tuple(x.shape[1:4])
    shifted = sum(shift) > 0
    if shifted:
        x = torch.roll(x, shifts=(-shift[0], -shift[1], -shift[2]), dims=(1, 2, 3))
    counts = [padded[i] // window[i] for i in range(3)]
    tokens = window[0] * window[1] * window[2]
    windows = x.view(batch, counts[0], window[0], counts[1], window[1], counts[2], window[2], -1)
    windows = windows.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, tokens, channels)

    heads = layer.num_heads
    qkv = layer.qkv(windows)
    head_dim = qkv.shape[-1] // (3 * heads)
    q, k, v = qkv.reshape(len(windows), tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    scores = (q * head_dim**-0.5).matmul(k.transpose(-2, -1)) + bias
    if shifted:
        mask = _compute_attention_mask_3d(windows, padded, tuple(window), tuple(shift))
        scores = scores.view(batch, len(windows) // batch, heads, tokens, tokens)
        scores = (scores + mask.unsqueeze(1).unsqueeze(0)).view(-1, heads, tokens, tokens)
    attention = scores.softmax(dim=-1)
    attention = nn.functional.dropout(attention, p=layer.attention_dropout, training=layer.training)

    out = attention.matmul(v).transpose(1, 2).reshape(len(windows), tokens, heads * head_dim)
    out = nn.functional.dropout(layer.proj(out), p=layer.dropout, training=layer.training)
    out = out.view(batch, *counts, *window, channels).permute(0, 1, 4, 2, 5, 3, 6, 7)
    out = out.reshape(batch, *padded, channels)
    if shifted:
        out = torch.roll(out, shifts=(shift[0], shift[1], shift[2]), dims=(1, 2, 3))
    return out[:, :frames, :height, :width, :].contiguous()


class PrunedShiftedWindowAttention(GivenToTheLayer, ShiftedWindowAttention):
    """torchvision's ShiftedWindowAttention whose heads may be fewer than its input width
    over their size: what export makes of one that lost heads."""

    replaces = ShiftedWindowAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return window_attention(x, self)


class PrunedShiftedWindowAttentionV2(GivenToTheLayer, ShiftedWindowAttentionV2):
    """torchvision's ShiftedWindowAttentionV2 (cosine attention, per-head logit scale)
    whose heads may be fewer than its input width over their size."""

    replaces = ShiftedWindowAttentionV2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return window_attention(x, self, self.logit_scale)


class PrunedShiftedWindowAttention3d(GivenToTheLayer, ShiftedWindowAttention3d):
    """Video Swin's ShiftedWindowAttention3d whose heads may be fewer than its input
    width over their size."""

    replaces = ShiftedWindowAttention3d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return window_attention_3d(x, self)


class PrunedMaxVitAttention(GivenToTheLayer, RelativePositionalMultiHeadAttention):
    """torchvision MaxViT's RelativePositionalMultiHeadAttention whose heads may be fewer
    than the model width over their size (its scale stays the model width's)."""

    replaces = RelativePositionalMultiHeadAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, groups, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, G, P, H * DH) -> (B, G, H, P, DH)
            return t.reshape(batch, groups, tokens, self.n_heads, self.head_dim).transpose(2, 3)

        q, k, v = (heads(t) for t in self.to_qkv(x).chunk(3, dim=-1))
        scores = q @ (k * self.scale_factor).transpose(-2, -1)
        attention = (scores + self.get_relative_positional_bias()).softmax(dim=-1)
        out = (attention @ v).transpose(2, 3).reshape(batch, groups, tokens, -1)
        return self.merge(out)


# the class export gives a layer of each class that loses heads
PRUNED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    ShiftedWindowAttentionV2: PrunedShiftedWindowAttentionV2,
    ShiftedWindowAttention: PrunedShiftedWindowAttention,
    ShiftedWindowAttention3d: PrunedShiftedWindowAttention3d,
    RelativePositionalMultiHeadAttention: PrunedMaxVitAttention,
}
