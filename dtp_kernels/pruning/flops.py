"""Parameter and FLOPs counts of a model, with the paper's FLOPs convention.

FLOPs follow the appendix (Eq. flops_comput, after ChipNet): a convolution costs
(K * n_in / groups + 1) * n_out * A multiply-adds (K the kernel area, A the output
feature-map area, +1 for the bias term); a linear layer (n_in + 1) * n_out;
nonlinearities, BN and pooling are ignored.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def count_params(model: nn.Module) -> int:
    """Number of parameters (BN affine included; buffers excluded)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def count_flops(model: nn.Module, example_inputs: torch.Tensor | tuple) -> int:
    """FLOPs of one forward of `example_inputs` (batch 1 expected), the paper's convention."""
    total = 0

    def conv_hook(module: nn.Conv2d, _inputs, output: torch.Tensor) -> None:
        nonlocal total
        kernel = math.prod(module.kernel_size)
        area = math.prod(output.shape[2:])
        per_out = kernel * module.in_channels // module.groups + 1
        total += per_out * module.out_channels * area * output.shape[0]

    def linear_hook(module: nn.Linear, _inputs, output: torch.Tensor) -> None:
        nonlocal total
        total += (
            (module.in_features + 1)
            * module.out_features
            * output.numel()
            // max(module.out_features, 1)
        )

    handles = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            handles.append(module.register_forward_hook(conv_hook))
        elif isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(linear_hook))
    was_training = model.training
    model.eval()
    try:
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        model(*args)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return int(total)
