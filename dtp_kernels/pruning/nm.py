"""N:M sparsity (granularity="n:m"): every block of M consecutive weights along a layer's
input dimension keeps exactly N, the pattern GPUs run faster (2:4 on Ampere and later).

DTP learns it as its transport problem with one segment per block (k = N, n = M). A
weight tensor's blocks are laid out contiguously by moving the input dimension last
(Linear [out, in] as it is; Conv [out, in, kh, kw] as [out, kh, kw, in]), so the flat
scores, masks and transport segments of a layer are its blocks in order.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK_SIZES = (4, 8, 16)


def check_nm(nm: object) -> tuple[int, int]:
    """(N, M) with 1 <= N < M and M in BLOCK_SIZES, else ValueError naming `nm`."""
    if (
        not isinstance(nm, (tuple, list))
        or len(nm) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in nm)
    ):
        raise ValueError(f"nm = {nm!r}; it must be a pair (N, M) of integers, e.g. (2, 4)")
    n, m = nm
    if m not in BLOCK_SIZES or not 1 <= n < m:
        raise ValueError(f"nm = {tuple(nm)}; allowed: 1 <= N < M with M in {list(BLOCK_SIZES)}")
    return n, m


def check_layers(layers: dict[str, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d], m: int) -> None:
    """ValueError naming every layer whose input dimension is not a multiple of M."""
    bad = {
        name: layer.weight.shape[1]
        for name, layer in layers.items()
        if layer.weight.dim() < 2 or layer.weight.shape[1] % m
    }
    if bad:
        details = ", ".join(f"{name!r} ({width} inputs)" for name, width in bad.items())
        raise ValueError(
            f"N:M pruning needs every pruned layer's input dimension to be a multiple of "
            f"M = {m}: {details} is not; leave these layers whole with ignored_layers=[...] "
            "or a ratio of 0 for them"
        )


def to_blocks(weight: torch.Tensor) -> torch.Tensor:
    """The weight flattened in block order (its input dimension last)."""
    return weight.movedim(1, -1).flatten()


def to_weight(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A block-ordered flat tensor (a mask) back in the layout of `weight`."""
    moved = weight.movedim(1, -1).shape
    return flat.view(moved).movedim(-1, 1)


def hard_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """0/1 in block order: the N highest scores of every block of M."""
    blocks = scores.view(-1, m)
    mask = torch.zeros_like(blocks)
    mask.scatter_(1, torch.topk(blocks, n, dim=1, sorted=False).indices, 1.0)
    return mask.flatten()
