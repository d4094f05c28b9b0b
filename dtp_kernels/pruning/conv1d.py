"""transformers' ``Conv1D`` layers (GPT-2's) as the ``nn.Linear`` layers they are.

GPT-2 and the models written after it (OpenAI GPT, ImageGPT, Decision Transformer) store
each linear layer as transformers' ``Conv1D``: ``x @ weight + bias`` with the weight
transposed, ``(in, out)``. The pruner finds, masks and exports ``nn.Linear`` layers, so
such a model is converted first; :func:`conv1d_to_linear` does it in place, each layer
computing exactly what it did.
"""

from __future__ import annotations

import torch
from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is transformers' Conv1D (known by its class, without importing
    transformers)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _as_linear(conv: nn.Module) -> nn.Linear:
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
    ``from_pretrained`` expects: save it with :func:`dtp_kernels.save_pruned`, not
    ``save_pretrained`` (the pruner's export warns of this)."""
    linears: dict[nn.Module, nn.Linear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_conv1d(child):
                if child not in linears:
                    linears[child] = _as_linear(child)
                setattr(parent, name, linears[child])
    return model
