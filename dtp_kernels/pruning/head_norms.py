"""RMS normalizations over all the heads of an attention layer (the ``q_norm`` and
``k_norm`` of OLMo 2, OLMo 3, OLMoE, FlexOlmo and MiniMax-M2; BitNet's ``attn_sub_norm``
of the attention output), kept exact when heads go.

Such a norm computes every query from the mean square of all heads' queries, so a head
masked only at the output projection would still count in it. Its projection's rows are
masked too (the hard mask zeroes the removed units' queries before the norm), and then
removing them changes nothing: with the queries x of the K kept rows of N,

    w * x / sqrt(sum(x**2) / N + eps)  ==  (w / c) * (c * x) / sqrt(sum((c * x)**2) / K + eps)

for c = sqrt(K / N). Export cuts the norm to the kept rows, scales the projection's kept
rows by c and the norm's weight by 1 / c: weights only, so the config's epsilon still
describes the model. A norm of the attention output is the same with the value
projection's rows: the attention output is linear in the values, so zeroing a unit's
value rows zeroes its query heads' outputs and scaling the kept rows by c scales theirs
(x is then the kept query heads' output channels, more than the value rows under
grouped-query attention). A norm for which this does not hold on a random input (a
LayerNorm, which subtracts the mean; Gemma's 1 + weight) is left among those the pruner
refuses.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from .cost import run_hooked
from .groups import is_norm
from .module_tensors import tensor_of
from .proof import close, random_half


@dataclass
class RescaledNorm:
    """A norm over all the rows of one projection of an attention layer's heads, or over
    its output (then `rows` is the value projection): `rows` is one block, `per_unit`
    rows per unit, which the group's mask also masks."""

    norm: nn.Module
    rows: nn.Module  # a linear layer
    per_unit: int
    # the norm's channels per unit where they are not the rows' (a norm of the attention
    # output over the query heads, its rows the value projection's: grouped-query
    # attention has fewer value heads)
    channels: int = 0

    @property
    def channels_per_unit(self) -> int:
        return self.channels or self.per_unit


def norms_over_all_heads(module: nn.Module, head_dim: int) -> tuple[nn.Module, ...]:
    """The normalizations among `module`'s children with a weight of other than `head_dim`
    entries: over all heads together (OLMo 2's q_norm), not one per head (Qwen3's)."""
    return tuple(
        child
        for child in module.children()
        if is_norm(child)
        and isinstance(weight := getattr(child, "weight", None), torch.Tensor)
        and weight.numel() != head_dim
    )


def fed_norms(
    model: nn.Module, inputs: tuple, candidates: dict[nn.Module, list[tuple[nn.Module, int]]]
) -> dict[nn.Module, tuple[nn.Module, int]]:
    """For each norm of `candidates` (norm: its attention layer's single-block projections,
    with their rows per unit), the projection whose output it normalizes as it is, seen
    in one eval forward of `model` on `inputs`; a norm reading anything else is absent."""
    last: dict[nn.Module, torch.Tensor] = {}  # each projection's latest output
    fed: dict[nn.Module, tuple[nn.Module, int]] = {}

    def produced(module, _args, output):
        last[module] = output

    def normalizes(norm, args):
        for layer, per_unit in candidates[norm]:
            if args and args[0] is last.get(layer):
                fed.setdefault(norm, (layer, per_unit))

    layers = {layer for options in candidates.values() for layer, _ in options}
    handles = [layer.register_forward_hook(produced) for layer in layers]
    handles += [norm.register_forward_pre_hook(normalizes) for norm in candidates]
    with torch.no_grad():
        run_hooked(model, inputs, handles)
    return fed


def _view_of(tensor: object, output: torch.Tensor) -> bool:
    """Whether `tensor` is `output` or a view of all of it (a transpose: NeXt-ViT's norm
    of its pooled keys' and values' input is transposed back to tokens)."""
    if tensor is output:
        return True
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.numel() == output.numel()
        and tensor.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
    )


def norms_read_by(
    model: nn.Module, inputs: tuple, candidates: dict[nn.Module, list[nn.Module]]
) -> set[nn.Module]:
    """The norms of `candidates` (norm: layers that may read it) whose output one of
    those layers reads as its input, seen in one eval forward of `model` on `inputs`: a
    norm of an attention layer's input, read by its query, key or value projection
    (LongT5's norm of its global tokens, of the model width, not over the heads), or a
    norm of its attention output, read by its output projection (BitNet's
    attn_sub_norm). A norm's output passed through a module without parameters that keeps
    its shape (an activation: PVT v2's GELU between the norm of its pooled tokens and its
    key/value projection) is still its output."""
    last: dict[nn.Module, list[torch.Tensor]] = {}  # each norm's latest output and its maps
    found: set[nn.Module] = set()

    def produced(norm, _args, output):
        last[norm] = [output]

    def mapped(_module, args, output):
        for outputs in last.values():
            if (
                args
                and isinstance(output, torch.Tensor)
                and output.shape == args[0].shape
                and any(_view_of(args[0], earlier) for earlier in outputs)
            ):
                outputs.append(output)

    def reads(layer, args):
        found.update(
            n
            for n, options in candidates.items()
            if layer in options
            and args
            and n in last
            and any(_view_of(args[0], output) for output in last[n])
        )

    layers = {layer for options in candidates.values() for layer in options}
    maps = [
        m
        for m in model.modules()
        if next(m.children(), None) is None and next(m.parameters(), None) is None
    ]
    handles = [norm.register_forward_hook(produced) for norm in candidates]
    handles += [m.register_forward_hook(mapped) for m in maps]
    handles += [layer.register_forward_pre_hook(reads) for layer in layers]
    with torch.no_grad():
        run_hooked(model, inputs, handles)
    return found


def norms_after_output(
    model: nn.Module, inputs: tuple, candidates: dict[nn.Module, nn.Module]
) -> set[nn.Module]:
    """The norms of `candidates` (norm: its attention layer's output projection) that
    first run after that projection, seen in one eval forward of `model` on `inputs`: a
    norm of the residual stream the projection writes into (ALBERT's LayerNorm inside
    its attention layer), of the model width, not over the heads."""
    ran: set[nn.Module] = set()
    found: set[nn.Module] = set()

    def projected(layer, _args, _output):
        ran.add(layer)

    def normalizes(norm, _args):
        if norm not in ran and candidates[norm] in ran:
            found.add(norm)
        ran.add(norm)

    outputs = set(candidates.values())
    handles = [layer.register_forward_hook(projected) for layer in outputs]
    handles += [norm.register_forward_pre_hook(normalizes) for norm in candidates]
    with torch.no_grad():
        run_hooked(model, inputs, handles)
    return found


def cut_norm(norm: nn.Module, rows: nn.Linear, kept: torch.Tensor) -> None:
    """Keep the `kept` channels of `norm` and the rows of `rows` already cut to them (in
    place), scaled so that the norm computes on them what it computed on all its channels
    with the others zero (see the module docstring)."""
    weight = tensor_of(norm)
    width = weight.shape[0]
    scale = math.sqrt(len(kept) / width)
    kept = kept.to(weight.device)
    norm.weight = nn.Parameter(_scaled(weight.detach()[kept], 1 / scale))
    if isinstance(getattr(norm, "normalized_shape", None), tuple):  # torch's nn.RMSNorm
        # (setattr: mypy types a module's attributes as tensors or modules)
        setattr(norm, "normalized_shape", (len(kept),))  # noqa: B010
    rows.weight = nn.Parameter(_scaled(rows.weight.detach(), scale))
    if rows.bias is not None:
        rows.bias = nn.Parameter(_scaled(rows.bias.detach(), scale))


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return (tensor.float() * factor).to(tensor.dtype)  # one rounding in half precision


def rescales_exactly(norm: nn.Module) -> bool:
    """Whether `norm`, cut to a random half of its channels by `cut_norm`, computes on
    them what it computes on all of them with the others zero: shown on a copy with a
    random weight (so a weight read as 1 + w shows), on a random input."""
    weight = tensor_of(norm)
    width = weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    kept = random_half(width, generator)
    dtype, device = weight.dtype, weight.device
    x = torch.randn(3, width, generator=generator).to(device, dtype)
    zeroed = torch.zeros_like(x)
    zeroed[:, kept.to(device)] = x[:, kept.to(device)]
    probe = copy.deepcopy(norm)
    probe.eval()
    rows = nn.Linear(width, width, bias=False).to(device, dtype)
    try:
        with torch.no_grad():
            tensor_of(probe).copy_(torch.rand(width, generator=generator) + 0.5)
            want = probe(zeroed)[:, kept.to(device)]
            rows.weight = nn.Parameter(torch.eye(width, dtype=dtype, device=device)[kept])
            cut_norm(probe, rows, kept)
            got = probe(rows(x))
    except Exception:  # its code reads the old width
        return False
    return close(got, want)
