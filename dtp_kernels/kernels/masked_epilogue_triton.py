"""Triton kernels of the masked-channel epilogue, out = act((y + bias[c]) * mask[c]).

Memory is viewed as [outer][C][inner] (NCHW: inner = H*W; channels-last or (N, C):
inner = 1). The forward is one elementwise pass. The backward writes dy and per-channel
partial sums in one pass (one partial per plane, or per block of rows), then a second
kernel adds the partials of each channel in a fixed order: no atomics, bitwise
reproducible. fp32 accumulation (fp64 for fp64 activations).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024
ROWS = 32  # rows per program in the channels-last backward
CHANNELS = 64  # channels per program in the channels-last backward and the final sum


@triton.jit
def _epilogue_fwd_kernel(
    y_ptr,
    mask_ptr,
    bias_ptr,
    out_ptr,
    numel,
    channels,
    inner,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < numel
    c = (idx // inner) % channels
    v = tl.load(y_ptr + idx, mask=valid, other=0.0).to(ACC)
    if HAS_BIAS:
        v += tl.load(bias_ptr + c, mask=valid, other=0.0).to(ACC)
    v = v * tl.load(mask_ptr + c, mask=valid, other=0.0).to(ACC)
    if RELU:
        v = tl.maximum(v, 0.0)
    tl.store(out_ptr + idx, v.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _epilogue_bwd_planes_kernel(
    grad_ptr,
    y_ptr,
    mask_ptr,
    bias_ptr,
    dy_ptr,
    part_gy_ptr,
    part_g_ptr,
    channels,
    inner,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    plane = tl.program_id(0).to(tl.int64)  # = outer index * channels + channel
    c = plane % channels
    m = tl.load(mask_ptr + c).to(ACC)
    b = tl.load(bias_ptr + c).to(ACC) if HAS_BIAS else 0.0
    sum_gy = tl.zeros((BLOCK,), ACC)
    sum_g = tl.zeros((BLOCK,), ACC)
    for start in range(0, inner, BLOCK):
        i = start + tl.arange(0, BLOCK)
        valid = i < inner
        offset = plane * inner + i
        yb = tl.load(y_ptr + offset, mask=valid, other=0.0).to(ACC) + b
        g = tl.load(grad_ptr + offset, mask=valid, other=0.0).to(ACC)
        if RELU:
            g = tl.where(yb * m > 0.0, g, 0.0)
        tl.store(dy_ptr + offset, (g * m).to(dy_ptr.dtype.element_ty), mask=valid)
        sum_gy += g * yb
        sum_g += g
    tl.store(part_gy_ptr + plane, tl.sum(sum_gy, axis=0))
    tl.store(part_g_ptr + plane, tl.sum(sum_g, axis=0))


@triton.jit
def _epilogue_bwd_rows_kernel(
    grad_ptr,
    y_ptr,
    mask_ptr,
    bias_ptr,
    dy_ptr,
    part_gy_ptr,
    part_g_ptr,
    rows,
    channels,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    CHANNELS: tl.constexpr,
):
    block = tl.program_id(0)
    r = block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    valid = (r[:, None] < rows) & (c[None, :] < channels)
    offset = r[:, None] * channels + c[None, :]
    m = tl.load(mask_ptr + c, mask=c < channels, other=0.0).to(ACC)[None, :]
    yb = tl.load(y_ptr + offset, mask=valid, other=0.0).to(ACC)
    if HAS_BIAS:
        yb += tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(ACC)[None, :]
    g = tl.load(grad_ptr + offset, mask=valid, other=0.0).to(ACC)
    if RELU:
        g = tl.where(yb * m > 0.0, g, 0.0)
    tl.store(dy_ptr + offset, (g * m).to(dy_ptr.dtype.element_ty), mask=valid)
    tl.store(part_gy_ptr + block * channels + c, tl.sum(g * yb, axis=0), mask=c < channels)
    tl.store(part_g_ptr + block * channels + c, tl.sum(g, axis=0), mask=c < channels)


@triton.jit
def _sum_partials_kernel(
    part_gy_ptr,
    part_g_ptr,
    mask_ptr,
    grad_mask_ptr,
    grad_bias_ptr,
    parts,
    channels,
    ACC: tl.constexpr,
    CHANNELS: tl.constexpr,
):
    c = tl.program_id(0) * CHANNELS + tl.arange(0, CHANNELS)
    valid = c < channels
    sum_gy = tl.zeros((CHANNELS,), ACC)
    sum_g = tl.zeros((CHANNELS,), ACC)
    for p in range(0, parts):  # fixed order: the result does not depend on scheduling
        sum_gy += tl.load(part_gy_ptr + p * channels + c, mask=valid, other=0.0)
        sum_g += tl.load(part_g_ptr + p * channels + c, mask=valid, other=0.0)
    m = tl.load(mask_ptr + c, mask=valid, other=0.0).to(ACC)
    tl.store(grad_mask_ptr + c, sum_gy.to(grad_mask_ptr.dtype.element_ty), mask=valid)
    tl.store(grad_bias_ptr + c, (m * sum_g).to(grad_bias_ptr.dtype.element_ty), mask=valid)


def kernel_layout(y: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int, int]:
    """y in a layout the kernels read, and its (outer, channels, inner) memory shape."""
    channels = y.shape[dim]
    channels_last = (y.dim() == 4 and y.is_contiguous(memory_format=torch.channels_last)) or (
        y.dim() == 5 and y.is_contiguous(memory_format=torch.channels_last_3d)
    )
    if dim == 1 and channels_last and not y.is_contiguous():
        return y, y.numel() // max(channels, 1), channels, 1
    y = y.contiguous()
    return y, math.prod(y.shape[:dim]), channels, math.prod(y.shape[dim + 1 :])


def _acc(y: torch.Tensor):
    return tl.float64 if y.dtype == torch.float64 else tl.float32


def epilogue_forward(launch, y, mask, bias, relu: bool, dim: int):
    y, _outer, channels, inner = kernel_layout(y, dim)
    out = torch.empty_like(y)
    numel = y.numel()
    launch(_epilogue_fwd_kernel)[(triton.cdiv(numel, BLOCK),)](
        y,
        mask,
        mask if bias is None else bias,
        out,
        numel,
        channels,
        inner,
        HAS_BIAS=bias is not None,
        RELU=relu,
        ACC=_acc(y),
        BLOCK=BLOCK,
    )
    return out


def epilogue_backward(launch, grad, y, mask, bias, relu: bool, dim: int):
    y, outer, channels, inner = kernel_layout(y, dim)
    grad = torch.empty_like(y).copy_(grad) if grad.stride() != y.stride() else grad
    dy = torch.empty_like(y)
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    bias_arg = mask if bias is None else bias
    common = dict(HAS_BIAS=bias is not None, RELU=relu, ACC=_acc(y))
    if inner > 1:
        parts = outer
        part_gy = torch.empty((outer, channels), dtype=acc, device=y.device)
        part_g = torch.empty_like(part_gy)
        launch(_epilogue_bwd_planes_kernel)[(outer * channels,)](
            grad,
            y,
            mask,
            bias_arg,
            dy,
            part_gy,
            part_g,
            channels,
            inner,
            BLOCK=BLOCK,
            **common,
        )
    else:
        parts = triton.cdiv(outer, ROWS)
        part_gy = torch.empty((parts, channels), dtype=acc, device=y.device)
        part_g = torch.empty_like(part_gy)
        launch(_epilogue_bwd_rows_kernel)[(parts, triton.cdiv(channels, CHANNELS))](
            grad,
            y,
            mask,
            bias_arg,
            dy,
            part_gy,
            part_g,
            outer,
            channels,
            ROWS=ROWS,
            CHANNELS=CHANNELS,
            **common,
        )
    grad_mask = torch.empty_like(mask)
    grad_bias = torch.empty_like(mask if bias is None else bias)
    launch(_sum_partials_kernel)[(triton.cdiv(channels, CHANNELS),)](
        part_gy,
        part_g,
        mask,
        grad_mask,
        grad_bias,
        parts,
        channels,
        ACC=_acc(y),
        CHANNELS=CHANNELS,
    )
    return dy, grad_mask, grad_bias
