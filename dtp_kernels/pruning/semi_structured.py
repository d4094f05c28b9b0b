"""2:4 weights that run faster: an exported N:M model's Linear layers converted to torch's
semi-structured sparse tensors (`torch.sparse.to_sparse_semi_structured`), which GPUs of
compute capability 8.0 and later multiply with their sparse tensor cores.
"""

from __future__ import annotations

import torch
from torch import nn

# fp16 and bf16 are what the sparse kernels of both torch backends (CUTLASS, cuSPARSELt)
# take for Linear layers; their shape rules come from torch's own classes.
DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)


def is_two_four(weight: torch.Tensor) -> bool:
    """Whether every block of 4 consecutive weights along the input dimension (the last)
    holds at most 2 non-zeros: the pattern the sparse tensor cores take."""
    if weight.dim() != 2 or weight.shape[1] % 4:
        return False
    return bool(((weight != 0).view(weight.shape[0], -1, 4).sum(-1) <= 2).all())


def _shape_rule(dtype: torch.dtype) -> tuple[int, int]:
    """(rows, columns) a weight's shape must be a multiple of, for the torch sparse class
    that to_sparse_semi_structured uses here."""
    from torch.sparse import semi_structured as ss

    cls = (  # the choice to_sparse_semi_structured makes
        ss.SparseSemiStructuredTensorCUTLASS
        if ss.SparseSemiStructuredTensor._FORCE_CUTLASS
        else ss.SparseSemiStructuredTensorCUSPARSELT
    )
    rule = cls._DTYPE_SHAPE_CONSTRAINTS[dtype]
    return rule.sparse_min_rows, rule.sparse_min_cols


def _problem(name: str, layer: nn.Linear) -> str | None:
    """Why `layer` cannot become semi-structured, or None."""
    weight = layer.weight
    if weight.device.type != "cuda":
        return f"{name!r} is on {weight.device}; semi-structured sparse tensors need CUDA"
    capability = torch.cuda.get_device_capability(weight.device)
    if capability < MIN_CAPABILITY:
        return (
            f"{name!r} is on a GPU of compute capability {capability}; sparse tensor cores "
            f"need {MIN_CAPABILITY} or later"
        )
    if weight.dtype not in DTYPES:
        return f"{name!r} has dtype {weight.dtype}; allowed: {[str(d) for d in DTYPES]}"
    rows, cols = _shape_rule(weight.dtype)
    if weight.shape[0] % rows or weight.shape[1] % cols:
        return (
            f"{name!r} has weight shape {tuple(weight.shape)}; both dimensions must be "
            f"multiples of ({rows}, {cols}) for {weight.dtype}"
        )
    return None


@torch.no_grad()
def to_semi_structured(model: nn.Module) -> list[str]:
    """Convert, in place, the weight of every nn.Linear of `model` that is in the 2:4
    pattern (an exported ``granularity="n:m"``, ``nm=(2, 4)`` model: ``is_two_four``)
    into a semi-structured sparse tensor; Linear layers not in the pattern stay dense.
    Inference only (the sparse weight is not trained).

    Every candidate is checked first (CUDA, compute capability 8.0 or later, float16 or
    bfloat16, torch's shape multiples); if any cannot be converted, ValueError names each
    such layer and nothing is changed. Returns the names of the converted layers.
    """
    candidates = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and is_two_four(module.weight)
    }
    problems = [p for name, layer in candidates.items() if (p := _problem(name, layer))]
    if problems:
        raise ValueError("cannot convert to semi-structured sparsity: " + "; ".join(problems))
    for layer in candidates.values():
        sparse = torch.sparse.to_sparse_semi_structured(layer.weight.detach().contiguous())
        layer.weight = nn.Parameter(sparse, requires_grad=False)
    return list(candidates)
