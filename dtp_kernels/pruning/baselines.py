"""Baselines behind the same interface, for comparisons at the same kept counts:
L1-norm one-shot filter pruning (Li et al. 2017) and random pruning."""

from __future__ import annotations

import torch

from .base import ChannelPruner


class L1Pruner(ChannelPruner):
    """Keep the k filters (heads, neurons) of largest L1 norm in each group (one shot)."""

    def channel_scores(self) -> torch.Tensor:
        return torch.cat([g.unit_weights().abs().sum(1) for g in self.groups])


class RandomPruner(ChannelPruner):
    """Keep k random filters of each group (seeded, so repeatable)."""

    _draw: torch.Tensor

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("_draw", torch.rand(sum(self.sizes), generator=generator))

    def channel_scores(self) -> torch.Tensor:
        return self._draw
