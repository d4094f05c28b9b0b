"""Full-precision float32 while a check compares two models' outputs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """Float32 convolutions and matrix products in full precision while the block runs.

    On GPUs cuDNN runs float32 convolutions in TF32 by default (10-bit mantissa): the
    masked and the exported model, whose convolutions differ in size and algorithm, then
    differ by ~1e-3, far beyond the export check's float32 tolerance. Set and restored
    through torch's fp32_precision settings, which work whichever TF32 API the user
    chose (reading the legacy ``allow_tf32`` after the new API was used raises).
    """
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    matmul.fp32_precision = conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
