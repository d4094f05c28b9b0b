"""Frozen batch norms: a BN whose statistics and affine parameters are buffers, applied
per channel (torchvision's FrozenBatchNorm2d, which its detection models build their
backbones with when they start from pretrained weights; detectron2's has the same
form). Torch-Pruning has no handler for them and would leave their buffers at the old
width; registered with it here, they are per-channel norms whose buffers it cuts with
the channels. They have no affine parameters to mask, so the mask goes on their output.
"""

from __future__ import annotations

import torch
from torch import nn
from torch_pruning.pruner.function import BasePruningFunc

BUFFERS = ("weight", "bias", "running_mean", "running_var")


def is_frozen_batch_norm(module: nn.Module) -> bool:
    """A batch norm (by its class name) with no parameters and the four per-channel
    buffers of one width."""
    buffers = dict(module.named_buffers(recurse=False))
    if "batchnorm" not in type(module).__name__.lower():
        return False
    if next(module.parameters(recurse=False), None) is not None:
        return False
    if not all(isinstance(buffers.get(name), torch.Tensor) for name in BUFFERS):
        return False
    return len({buffers[name].shape for name in BUFFERS}) == 1 and buffers["weight"].dim() == 1


def _buffers(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The four buffers of a layer is_frozen_batch_norm accepted."""
    buffers = {name: layer._buffers.get(name) for name in BUFFERS}
    present = {name: b for name, b in buffers.items() if b is not None}
    if len(present) != len(BUFFERS):
        raise TypeError(f"{type(layer).__name__} is not a frozen batch norm ({BUFFERS})")
    return present


class FrozenBatchNormPruner(BasePruningFunc):
    """Cuts a frozen batch norm's buffers (and `num_features`, where it has one)."""

    def prune_out_channels(self, layer: nn.Module, idxs: list[int]) -> nn.Module:
        gone = set(idxs)
        keep = [i for i in range(self.get_out_channels(layer)) if i not in gone]
        buffers = _buffers(layer)
        index = torch.tensor(keep, dtype=torch.long, device=buffers["weight"].device)
        for name in BUFFERS:
            layer._buffers[name] = buffers[name].index_select(0, index)
        if isinstance(getattr(layer, "num_features", None), int):
            # (setattr: mypy types a module's attributes as tensors or modules)
            setattr(layer, "num_features", len(keep))  # noqa: B010
        return layer

    prune_in_channels = prune_out_channels

    def get_out_channels(self, layer: nn.Module) -> int:
        return _buffers(layer)["weight"].numel()

    get_in_channels = get_out_channels


FROZEN_BATCH_NORM = FrozenBatchNormPruner()


def frozen_norm_pruners(model: nn.Module) -> dict[type, BasePruningFunc]:
    """Torch-Pruning's `customized_pruners` for the frozen batch norms in `model`."""
    return {type(m): FROZEN_BATCH_NORM for m in model.modules() if is_frozen_batch_norm(m)}
