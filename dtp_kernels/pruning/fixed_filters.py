"""Fixed per-channel filters: a module with no parameters that convolves each channel with
a filter held in a buffer of one row per channel (timm's BlurPool2d, which TResNet and
the anti-aliased ResNets downsample with; antialiased-cnns' Downsample has the same
form). Its convolution is functional, so Torch-Pruning sees an elementwise op and would
leave the buffer, and the `groups` it is called with, at the old width. Registered with
it here, they are per-channel ops whose buffer it cuts with the channels. A filter of
zeros is zeros, so the mask stays where the group puts it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch_pruning.pruner.function import BasePruningFunc


def _filter(module: nn.Module) -> torch.Tensor | None:
    """The module's per-channel filter, (channels, 1, *kernel), when it has one buffer,
    of that form, no parameters and no submodules."""
    if next(module.parameters(), None) is not None or next(module.children(), None):
        return None
    buffers = list(module.buffers(recurse=False))
    if len(buffers) != 1 or buffers[0].dim() not in (3, 4):
        return None
    filt = buffers[0]
    return filt if filt.shape[0] > 1 and filt.shape[1] == 1 else None


def _filter_of(layer: nn.Module) -> torch.Tensor:
    """The filter of a layer is_fixed_filter accepted."""
    filt = _filter(layer)
    if filt is None:
        raise TypeError(f"{type(layer).__name__} holds no fixed filter per channel")
    return filt


def is_fixed_filter(module: nn.Module) -> bool:
    """A parameter-free module whose one buffer is a filter per channel."""
    return _filter(module) is not None


class FixedFilterPruner(BasePruningFunc):
    """Cuts a fixed filter's buffer (and its `channels`, where it holds the width)."""

    def prune_out_channels(self, layer: nn.Module, idxs: list[int]) -> nn.Module:
        filt = _filter_of(layer)
        width = filt.shape[0]
        gone = set(idxs)
        keep = torch.tensor(
            [i for i in range(width) if i not in gone], dtype=torch.long, device=filt.device
        )
        name = next(n for n, b in layer.named_buffers(recurse=False) if b is filt)
        layer._buffers[name] = filt.index_select(0, keep)
        if getattr(layer, "channels", None) == width:  # the `groups` its forward passes
            # (setattr: mypy types a module's attributes as tensors or modules)
            setattr(layer, "channels", len(keep))  # noqa: B010
        return layer

    prune_in_channels = prune_out_channels

    def get_out_channels(self, layer: nn.Module) -> int:
        return _filter_of(layer).shape[0]

    get_in_channels = get_out_channels


FIXED_FILTER = FixedFilterPruner()


def fixed_filter_pruners(model: nn.Module) -> dict[type, BasePruningFunc]:
    """Torch-Pruning's `customized_pruners` for the fixed per-channel filters in `model`."""
    return {type(m): FIXED_FILTER for m in model.modules() if is_fixed_filter(m)}
