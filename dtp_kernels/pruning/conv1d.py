"""transformers' ``Conv1D`` layers (GPT-2's) as the ``nn.Linear`` layers they are.

GPT-2 and the models written after it (OpenAI GPT, ImageGPT, Decision Transformer) store
each linear layer as transformers' ``Conv1D``: ``x @ weight + bias`` with the weight
transposed, ``(in, out)``. The pruner finds, masks and exports ``nn.Linear`` layers, so
such a model is converted first; :func:`conv1d_to_linear` does it in place, each layer
computing exactly what it did. Export puts the Conv1D layers back
(:func:`linear_to_conv1d`), so the exported model has its class's layout and its
config, ``save_pretrained`` and ``from_pretrained`` describe it.
"""

from __future__ import annotations

import copy
import sys
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers.pytorch_utils import Conv1D


def is_conv1d(module: nn.Module) -> TypeGuard[Conv1D]:
    """Whether `module` is transformers' Conv1D (known by its class, without importing
    transformers)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _as_linear(conv: Conv1D) -> nn.Linear:
    inputs, outputs = conv.weight.shape
    weight = conv.weight
    linear = nn.Linear(
        inputs, outputs, bias=conv.bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    linear.weight.requires_grad_(weight.requires_grad)
    if conv.bias is not None:
        linear.bias.requires_grad_(conv.bias.requires_grad)
    return linear.train(conv.training)


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace every transformers ``Conv1D`` in `model` by the equal ``nn.Linear``, in
    place, and return `model`. The replaced layers get new parameters: call it before
    making the optimizer. A Conv1D used at several places becomes one Linear.

    The converted model's weights are transposed against the Conv1D layout its
    ``from_pretrained`` expects; the pruner's export puts the Conv1D layers back
    (:func:`linear_to_conv1d`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    linears: dict[nn.Module, nn.Linear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_conv1d(child):
                if child not in linears:
                    linears[child] = _as_linear(child)
                setattr(parent, name, linears[child])
    return model


def _as_conv1d(linear: nn.Linear) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    weight = linear.weight
    conv = Conv1D(linear.out_features, linear.in_features).to(weight.device, weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(weight.t())
        conv.bias.copy_(linear.bias if linear.bias is not None else torch.zeros_like(conv.bias))
    conv.weight.requires_grad_(weight.requires_grad)
    conv.bias.requires_grad_(linear.bias is None or linear.bias.requires_grad)
    return conv.train(linear.training)


def _builds_conv1d(module: nn.Module) -> bool:
    """Whether `module` is a transformers model whose modeling code uses Conv1D."""
    config = getattr(module, "config", None)
    code = sys.modules.get(type(module).__module__)
    return hasattr(config, "to_dict") and getattr(code, "Conv1D", None) is not None


def linear_to_conv1d(model: nn.Module) -> nn.Module:
    """Put transformers' Conv1D layers back, in place, where a transformers model in
    `model` holds an ``nn.Linear`` (of any size: pruned or not) at a place its class
    builds a Conv1D (found by building the class from its config on the meta device),
    each computing what it did; return `model`. The inverse of :func:`conv1d_to_linear`:
    the model then has the layout ``save_pretrained`` and ``from_pretrained`` expect. A
    Linear used at several places becomes one Conv1D."""
    made: dict[nn.Linear, nn.Module] = {}
    for sub in [m for m in model.modules() if _builds_conv1d(m)]:
        try:
            with torch.device("meta"):
                fresh = type(sub)(copy.deepcopy(sub.config))
        except Exception:  # a class not built from its config alone: left as it is
            continue
        layers = dict(sub.named_modules())
        for name, built in fresh.named_modules():
            linear = layers.get(name)
            if is_conv1d(built) and type(linear) is nn.Linear:
                if linear not in made:
                    made[linear] = _as_conv1d(linear)
                parent, _, attribute = name.rpartition(".")
                setattr(sub.get_submodule(parent), attribute, made[linear])
    return model
