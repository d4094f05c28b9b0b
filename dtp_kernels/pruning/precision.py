"""Full-precision float32 while a check compares two models' outputs: float32 products
(no TF32), and half-precision weights held in float32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """Float32 convolutions, recurrent layers and matrix products in full precision while
    the block runs.

    On GPUs cuDNN runs float32 convolutions and recurrent layers in TF32 by default
    (10-bit mantissa): the masked and the exported model, whose layers differ in size and
    algorithm, then differ by ~1e-3, far beyond the export check's float32 tolerance. Set
    and restored through torch's fp32_precision settings, which work whichever TF32 API
    the user chose (reading the legacy ``allow_tf32`` after the new API was used raises).
    """
    # (torch's type stubs lack cudnn.conv and cudnn.rnn, their fp32_precision settings)
    cudnn = torch.backends.cudnn
    settings = [torch.backends.cuda.matmul, cudnn.conv, cudnn.rnn]  # type: ignore[attr-defined]
    before = [setting.fp32_precision for setting in settings]
    for setting in settings:
        setting.fp32_precision = "ieee"
    try:
        yield
    finally:
        for setting, precision in zip(settings, before, strict=True):
            setting.fp32_precision = precision


HALF = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def float32_weights(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s half-precision parameters and buffers held in float32 while the block
    runs, then given back their own dtypes: exactly the values they had, since every
    float16 and bfloat16 value is a float32 one. The parameters stay the same objects (an
    optimizer's references hold); the memory of those tensors doubles meanwhile."""
    parameters = [p for p in model.parameters() if p.dtype in HALF]
    buffers = [
        (module, name, buffer)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and buffer.dtype in HALF
    ]
    dtypes = [p.dtype for p in parameters]
    try:
        for parameter in parameters:
            parameter.data = parameter.data.float()
        for module, name, buffer in buffers:
            module._buffers[name] = buffer.float()
        yield
    finally:
        for parameter, dtype in zip(parameters, dtypes, strict=True):
            parameter.data = parameter.data.to(dtype)
        for module, name, buffer in buffers:
            module._buffers[name] = buffer  # the tensor it held
