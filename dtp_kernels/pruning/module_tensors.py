"""A module's tensor by name, typed: mypy reads every attribute of an nn.Module as
`Tensor | Module` (nn.Module.__getattr__), and the layers the pruner meets are known
only when it runs (a norm of any library, a frozen batch norm, an expert block)."""

from __future__ import annotations

import torch
from torch import nn


def tensor_of(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """`module`'s parameter, buffer or tensor attribute `name` (a parametrized one's
    value, as attribute access gives it); TypeError naming the module and the attribute
    when that is not a tensor."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(value).__name__}, not a tensor")
    return value
