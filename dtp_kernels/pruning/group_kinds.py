"""The kind of each group, as ratio dicts name it ("heads", "mlp", ...), and the
kinds found without Torch-Pruning's dependency graph."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from .channel_graph import ChannelGraphError, GraphBuildError
from .experts import ExpertGroup
from .gated_deltanet import LinearAttentionGroup
from .heads import HeadGroup
from .mamba import MambaGroup
from .mamba2 import Mamba2Group
from .whole_experts import WholeExpertsGroup


def kind_of(group) -> str:
    """The group's kind for ratio dicts: "heads", "linear_attention", "experts",
    "whole_experts", "mamba", "coupled", "mlp", "channels"."""
    if isinstance(group, WholeExpertsGroup):
        return "whole_experts"
    if isinstance(group, LinearAttentionGroup):
        return "linear_attention"
    if isinstance(group, HeadGroup):
        return "heads"
    if isinstance(group, (MambaGroup, Mamba2Group)):
        return "mamba"
    if isinstance(group, ExpertGroup):
        return "experts"
    if getattr(group, "producers", None):
        return "coupled"
    return "mlp" if isinstance(group.layer, nn.Linear) else "channels"


# the kinds of group found without Torch-Pruning's graph (MLPs: where it fails, by form)
GRAPHLESS_KINDS = ("heads", "linear_attention", "experts", "whole_experts", "mamba", "mlp")


def asks_only_graphless(ratios, groups: list) -> bool:
    """Whether `ratios` asks only for what is found without Torch-Pruning's graph (a dict
    whose every key is one of GRAPHLESS_KINDS or names some of `groups`, the model's
    heads, experts, Mamba mixers and MLP modules found by their form)."""
    if not isinstance(ratios, Mapping):
        return False
    names = [g.name for g in groups]
    return all(
        key in GRAPHLESS_KINDS or any(fnmatch.fnmatchcase(name, key) for name in names)
        for key in ratios
    )


def with_kinds_found(error: ChannelGraphError, ratios, groups: list) -> ChannelGraphError:
    """The graph's failure to be built at all, for a float ratio with the dict of ratios
    that prunes, at it, the kinds of group found without the graph; any other failure
    (a search naming the layers to leave whole) as it is."""
    kinds = {kind_of(g) for g in groups}
    numeric = isinstance(ratios, (int, float)) and not isinstance(ratios, bool)
    if not isinstance(error, GraphBuildError) or not numeric or not kinds:
        return error
    advice = {kind: ratios for kind in GRAPHLESS_KINDS if kind in kinds}
    found = GraphBuildError(f"{error}. This model's groups found without it: ratios={advice}")
    found.__cause__ = error.__cause__
    return found
