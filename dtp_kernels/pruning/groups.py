"""Prunable channel groups, found with Torch-Pruning's DependencyGraph.

A group is the output channels of one convolution, or the output features of one linear
layer (an MLP's hidden neurons), together with everything coupled to them (its BN, the
next layers' input channels, depthwise convolutions in between). Groups whose channels
meet a residual add or a concatenation involve several layers' outputs; following the
paper (for ResNets: the last convolution of a residual block is not pruned), those are
left alone, so a basic block prunes its first convolution and a bottleneck its first two.
A layer whose outputs no layer consumes (the classifier, any model output) keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch_pruning as tp
from torch import nn


@dataclass
class ChannelGroup:
    name: str  # the root layer's module name
    layer: nn.Conv1d | nn.Conv2d | nn.Linear  # the root: its output channels (features)
    bn: nn.modules.batchnorm._BatchNorm | None  # the group's last affine op, when a BN
    size: int
    kept_out: list[nn.Module] = field(default_factory=list)  # modules losing output channels
    kept_in: list[nn.Module] = field(default_factory=list)  # modules losing input channels
    # normalizations other than BatchNorm that the group's channels pass through: they mix
    # channels (GroupNorm, LayerNorm) or add a bias to masked ones (InstanceNorm), so the
    # masked model and the exported one would differ (the pruner refuses such a group)
    norms: list[nn.Module] = field(default_factory=list)
    # where a parameter mask goes when `bn` is None: the rows of the root, or of the
    # depthwise conv after it whose bias would otherwise be added to masked channels
    rows: nn.Module | None = None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = self.layer


CHANNEL_MIXING_NORMS = (
    tp.prune_groupnorm_out_channels,
    tp.prune_layernorm_out_channels,
    tp.prune_instancenorm_out_channels,
)


def _is_depthwise(module: nn.Module) -> bool:
    return (
        isinstance(module, (nn.Conv1d, nn.Conv2d))
        and module.groups > 1
        and (module.groups == module.in_channels == module.out_channels)
    )


def build_graph(model: nn.Module, example_inputs) -> tp.DependencyGraph:
    return tp.DependencyGraph().build_dependency(model, example_inputs=example_inputs)


def find_groups(
    model: nn.Module, graph: tp.DependencyGraph, ignored: list[nn.Module]
) -> list[ChannelGroup]:
    """All prunable groups, in model order."""
    names = {module: name for name, module in model.named_modules()}
    order = {module: index for index, module in enumerate(model.modules())}
    ignored_all = list(ignored)
    found = {}
    roots = [nn.Conv1d, nn.Conv2d, nn.Linear]
    for group in graph.get_all_groups(ignored_layers=ignored_all, root_module_types=roots):
        out_layers, bns, outs, ins, norms, depthwise = [], [], [], [], [], []
        for dep, _idxs in group:
            module, handler = dep.target.module, dep.handler
            if handler in (tp.prune_conv_out_channels, tp.prune_depthwise_conv_out_channels):
                outs.append(module)
                if not _is_depthwise(module):
                    out_layers.append(module)
                elif module.bias is not None:
                    depthwise.append(module)
            elif handler == tp.prune_linear_out_channels:
                outs.append(module)
                out_layers.append(module)
            elif handler == tp.prune_batchnorm_out_channels:
                bns.append(module)
                outs.append(module)
            elif handler in CHANNEL_MIXING_NORMS:
                norms.append(module)
            elif handler in (
                tp.prune_conv_in_channels,
                tp.prune_depthwise_conv_in_channels,
                tp.prune_linear_in_channels,
            ):
                ins.append(module)
        if len(out_layers) != 1 or out_layers[0] in ignored or not ins:
            continue  # coupled through a residual add or a concatenation, ignored, or an output
        layer = out_layers[0]
        # Mask at the last affine op before the nonlinearity that ends the group: a
        # depthwise conv (with a bias) or its BN after the root would otherwise add its
        # bias back to the masked channels.
        last = max([*bns, *depthwise], key=lambda m: order[m], default=None)
        bn = last if last in bns else None
        rows = last if last in depthwise else layer
        size = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        found[layer] = ChannelGroup(names[layer], layer, bn, size, outs, ins, norms, rows)
    return [found[m] for m in model.modules() if m in found]
