"""Cutting a layer to the units export keeps: the one place a linear layer, a depthwise
convolution, a batch norm or a recurrent layer's inputs lose rows or columns (heads,
MLPs found by form, Mamba and Mamba-2 mixers, recurrent readers, and the proofs' copies
of a layer cut to its kept inputs).
Each cut makes new parameters, keeping whether they train."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

M = TypeVar("M", bound=nn.Module)


def kept_rows(tensor: torch.Tensor, keep: torch.Tensor, dim: int = 0) -> nn.Parameter:
    """A new parameter of `tensor`'s entries `keep` along `dim`."""
    kept = tensor.detach().index_select(dim, keep.to(tensor.device)).clone()
    return nn.Parameter(kept, requires_grad=tensor.requires_grad)


def as_linear(module: nn.Module) -> nn.Linear:
    """`module`, a linear layer by construction (an exported copy of one); TypeError
    naming its class otherwise."""
    return of_kind(module, nn.Linear)


def of_kind(module: nn.Module, kind: type[M]) -> M:
    """`module`, of the class `kind` by construction (an exported copy of a layer the
    pruner found as one); TypeError naming both classes otherwise."""
    if not isinstance(module, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(module).__name__}")
    return module


def cut_linear(layer: nn.Linear, keep: torch.Tensor, dim: int = 0) -> None:
    """Keep the rows (dim 0: outputs, with the bias) or columns (dim 1: inputs) `keep`
    of `layer`, in place."""
    layer.weight = kept_rows(layer.weight, keep, dim)
    if dim == 0:
        if layer.bias is not None:
            layer.bias = kept_rows(layer.bias, keep)
        layer.out_features = len(keep)
    else:
        layer.in_features = len(keep)


def cut_diagonal_columns(
    layer: nn.Linear, runs: int, per_unit: int, units: int, keep: torch.Tensor
) -> None:
    """Keep the units `keep` of a linear layer block-diagonal over `runs` equal runs of
    `units` units of `per_unit` columns (DeepSeek-V4's grouped o_a_proj: its weight holds
    one run's columns, run g's rows reading run g's units), in place. Every run keeps as
    many units, each run its own: the rows stay, the columns become the kept units'."""
    run = units // runs
    weight = layer.weight.detach()
    blocks = weight.view(runs, weight.shape[0] // runs, run, per_unit)
    keep = keep.to(weight.device)
    local = [keep[(keep >= g * run) & (keep < (g + 1) * run)] - g * run for g in range(runs)]
    if len({len(kept) for kept in local}) != 1:
        raise ValueError(
            f"a block-diagonal projection of {runs} runs of {run} units must keep as many "
            f"units in each run, not {[len(kept) for kept in local]}"
        )
    kept = torch.stack([blocks[g].index_select(1, local[g]) for g in range(runs)])
    layer.weight = nn.Parameter(
        kept.reshape(weight.shape[0], -1).clone(), requires_grad=layer.weight.requires_grad
    )
    layer.in_features = layer.weight.shape[1]


def channel_dim(layer: nn.Module) -> int:
    """The dimension of a linear or recurrent layer's (last) or convolution's (1) input
    that holds its input channels."""
    return -1 if isinstance(layer, (nn.Linear, nn.RNNBase, nn.RNNCellBase)) else 1


def input_weights(layer: nn.RNNBase | nn.RNNCellBase) -> list[str]:
    """The names of the weights through which a recurrent layer (or cell) reads its
    input: its first layer's, in each direction (a cell's one)."""
    if isinstance(layer, nn.RNNCellBase):
        return ["weight_ih"]
    return ["weight_ih_l0", "weight_ih_l0_reverse"] if layer.bidirectional else ["weight_ih_l0"]


def cut_inputs(layer: nn.Module, keep: torch.Tensor) -> None:
    """Keep the input channels (columns) `keep` of a linear layer, an ungrouped
    convolution or a recurrent layer or cell (`input_weights`), in place."""
    if isinstance(layer, (nn.RNNBase, nn.RNNCellBase)):
        for name in input_weights(layer):
            # (setattr: nn.RNNBase keeps its flat weight list in step with the attribute)
            setattr(layer, name, kept_rows(getattr(layer, name), keep, 1))
        layer.input_size = len(keep)
        if isinstance(layer, nn.RNNBase):
            layer.flatten_parameters()  # cuDNN's one buffer of weights again (on CUDA)
        return
    weight = layer.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(layer).__name__}.weight is a {type(weight).__name__}")
    layer.weight = kept_rows(weight, keep, 1)
    if isinstance(layer, nn.Linear):
        layer.in_features = len(keep)
    else:  # (setattr: mypy types a module's attributes as tensors or modules)
        setattr(layer, "in_channels", len(keep))  # noqa: B010


def cut_depthwise(conv: _ConvNd, keep: torch.Tensor) -> None:
    """Keep the channels `keep` of a depthwise convolution, in place."""
    conv.weight = kept_rows(conv.weight, keep)
    if conv.bias is not None:
        conv.bias = kept_rows(conv.bias, keep)
    conv.in_channels = conv.out_channels = conv.groups = len(keep)


def cut_batch_norm(norm: _BatchNorm, keep: torch.Tensor) -> None:
    """Keep the channels `keep` of a batch norm (its affine parameters and running
    statistics), in place."""
    for name in ("weight", "bias"):
        if getattr(norm, name, None) is not None:
            setattr(norm, name, kept_rows(getattr(norm, name), keep))
    for name in ("running_mean", "running_var"):
        statistic = getattr(norm, name, None)
        if statistic is not None:
            setattr(norm, name, statistic.index_select(0, keep.to(statistic.device)))
    norm.num_features = len(keep)
