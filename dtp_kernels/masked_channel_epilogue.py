"""The masked-channel epilogue op: out = act((y + bias[c]) * mask[c]) in one pass.

Where a group's mask cannot be folded into an affine layer's parameters (frozen or
quantized weights, a producer that is not affine), it is applied to the activations
(docs/design.md section 2). Masks are non-negative, so the mask commutes with ReLU.
Backends: "torch" (eager), "cpu" and "cuda" (kernels in csrc/), "triton", "auto".
"""

from __future__ import annotations

import torch

from ._extension import (
    BACKENDS,
    available_backends,
    compiled,
    require_backend,
    triton_installed,
)

ACTIVATIONS = (None, "relu")


def _check(y, mask, bias, activation, channel_dim) -> int:
    """Validate; return channel_dim as a non-negative index."""
    if not isinstance(y, torch.Tensor) or y.is_complex() or not y.is_floating_point():
        raise TypeError(
            "y must be a float16, bfloat16, float32 or float64 tensor, got "
            f"{getattr(y, 'dtype', type(y).__name__)}"
        )
    if y.dim() < 2:
        raise ValueError(f"y must have at least 2 dims (N, C, ...), got shape {tuple(y.shape)}")
    if isinstance(channel_dim, bool) or not isinstance(channel_dim, int):
        raise TypeError(f"channel_dim must be an int, got {type(channel_dim).__name__}")
    if not -y.dim() <= channel_dim < y.dim():
        raise ValueError(
            f"channel_dim = {channel_dim} is outside [{-y.dim()}, {y.dim() - 1}] for a "
            f"{y.dim()}-D y"
        )
    dim = channel_dim % y.dim()
    channels = y.shape[dim]
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor) or t.is_complex() or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor of shape ({channels},)")
        if t.shape != (channels,):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; y has {channels} channels on dim {dim}, "
                f"so {name} must have shape ({channels},)"
            )
        if t.device != y.device:
            raise ValueError(f"{name} is on {t.device} but y is on {y.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation = {activation!r}; allowed: {list(ACTIVATIONS)}")
    return dim


def _epilogue_torch(y, mask, bias, activation, dim):
    shape = [1] * y.dim()
    shape[dim] = -1
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    out = y.to(acc)
    if bias is not None:
        out = out + bias.to(acc).view(shape)
    out = out * mask.to(acc).view(shape)
    if activation == "relu":
        out = torch.relu(out)
    return out.to(y.dtype)


def _epilogue_compiled(y, mask, bias, activation, dim):
    return torch.ops.dtp.masked_channel_epilogue(y, mask, bias, activation or "none", dim)


Tensor = torch.Tensor

if triton_installed():
    from torch.library import triton_op, wrap_triton

    from .kernels import masked_epilogue_triton as _tk

    @triton_op("dtp::masked_channel_epilogue_triton", mutates_args=())
    def _epilogue_triton_op(
        y: Tensor, mask: Tensor, bias: Tensor | None, relu: bool, channel_dim: int
    ) -> Tensor:
        return _tk.epilogue_forward(wrap_triton, y, mask, bias, relu, channel_dim)

    @triton_op("dtp::masked_channel_epilogue_triton_backward", mutates_args=())
    def _epilogue_triton_backward_op(
        grad: Tensor, y: Tensor, mask: Tensor, bias: Tensor | None, relu: bool, channel_dim: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        return _tk.epilogue_backward(wrap_triton, grad, y, mask, bias, relu, channel_dim)

    def _triton_setup_context(ctx, inputs, output) -> None:
        y, mask, bias, relu, channel_dim = inputs
        ctx.save_for_backward(y, mask, bias)
        ctx.relu, ctx.channel_dim = relu, channel_dim

    def _triton_backward(ctx, grad):
        y, mask, bias = ctx.saved_tensors
        dy, dmask, dbias = _epilogue_triton_backward_op(
            grad, y, mask, bias, ctx.relu, ctx.channel_dim
        )
        return dy, dmask, dbias if bias is not None else None, None, None

    _epilogue_triton_op.register_autograd(_triton_backward, setup_context=_triton_setup_context)


def _epilogue_triton(y, mask, bias, activation, dim):
    return _epilogue_triton_op(y, mask, bias, activation == "relu", dim)


_IMPLEMENTATIONS = {
    "torch": _epilogue_torch,
    "cpu": _epilogue_compiled,
    "cuda": _epilogue_compiled,  # the same op; the dispatcher picks the CUDA kernel
    "triton": _epilogue_triton,
}


def masked_channel_epilogue(
    y: torch.Tensor,
    mask: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    channel_dim: int = 1,
    backend: str = "auto",
) -> torch.Tensor:
    """``act((y + bias[c]) * mask[c])`` over the channels of ``y``, in one pass.

    Args:
        y: activations with channels on ``channel_dim``: NCHW (contiguous or
            channels_last), (N, C) with ``channel_dim=-1``, or any layout (others are
            copied to contiguous first). float16, bfloat16, float32 or float64.
        mask: per-channel mask, shape (C,), any float dtype (math in fp32, fp64 for fp64 y).
        bias: optional per-channel bias added before the mask, shape (C,).
        activation: None or "relu".
        channel_dim: the channel dimension of ``y``.
        backend: "auto", "torch", "cpu", "cuda" or "triton" (see ``available_backends``).

    Returns:
        A tensor shaped and typed like ``y`` (channels_last stays channels_last).
        Differentiable in ``y``, ``mask`` and ``bias``.
    """
    dim = _check(y, mask, bias, activation, channel_dim)
    if backend not in BACKENDS or backend == "reference":
        raise ValueError(
            f"backend = {backend!r}; allowed: {[b for b in BACKENDS if b != 'reference']}"
        )
    if backend == "auto":
        backend = available_backends(y.device)[-1]
    else:
        require_backend(backend, y.device)
    return _IMPLEMENTATIONS[backend](y, mask, bias, activation, dim)


def _fake(y, mask, bias, activation, channel_dim):
    return torch.empty_like(y)


def _fake_backward(grad_out, y, mask, bias, activation, channel_dim):
    grad_bias = torch.empty_like(bias) if bias is not None else torch.empty_like(mask)
    return torch.empty_like(y), torch.empty_like(mask), grad_bias


if compiled():  # the ops exist only when dtp_kernels._C loaded
    torch.library.register_fake("dtp::masked_channel_epilogue", _fake)
    torch.library.register_fake("dtp::masked_channel_epilogue_backward", _fake_backward)
