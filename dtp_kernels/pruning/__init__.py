"""Pruning (layer 3 of docs/design.md section 5): channel groups, ratios, budgets, where masks
are applied, the DTP pruner, export, baselines."""

from .base import ChannelPruner, ExportMismatchError
from .baselines import L1Pruner, RandomPruner
from .conv1d import conv1d_to_linear
from .prepare import prepare
from .pruner import DTPPruner
from .saving import load_pruned, save_pruned
from .semi_structured import to_semi_structured

__all__ = [
    "ChannelPruner",
    "DTPPruner",
    "ExportMismatchError",
    "L1Pruner",
    "RandomPruner",
    "conv1d_to_linear",
    "load_pruned",
    "prepare",
    "save_pruned",
    "to_semi_structured",
]
