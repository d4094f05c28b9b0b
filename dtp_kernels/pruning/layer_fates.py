"""What becomes of each conv and linear layer: the groups that cut it, or why it is
left whole (`ChannelPruner.left_whole`), and the warning about layers the example
never ran."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from .cost import COSTED
from .shared_weights import parameter_holders


def layer_fates(
    model: nn.Module,
    groups: list,
    ratios: dict[str, float],
    ignored: Sequence[nn.Module],
    ran: set[nn.Module],
    reasons: dict[nn.Module, str],
) -> dict[str, str | list[str]]:
    """Each conv and linear layer of `model` by name, in model order: the names of the
    groups with a ratio above 0 that cut it (rows or columns), or, where there are none,
    why it is left whole: a ratio of 0, `ignored`, not called on the example, or the
    reason the search for groups recorded in `reasons` (its channels meet a residual
    add, are the model's outputs, ...)."""
    cut_by: dict[nn.Module, list] = {}
    for group in groups:
        tables = [layer for layer, _, _ in getattr(group, "tables", ())]
        for layer in (
            *getattr(group, "kept_out", ()),
            *getattr(group, "kept_in", ()),
            *tables,
            getattr(group, "layer", None),
        ):
            if isinstance(layer, nn.Module) and group not in cut_by.setdefault(layer, []):
                cut_by[layer].append(group)
    # a layer holding a tensor a group cuts in another (an adapter of a shared block
    # that only another layer runs) is cut with it
    modules, holders = dict(model.named_modules()), parameter_holders(model)
    for layer, cutting in list(cut_by.items()):
        for parameter in layer.parameters(recurse=False):
            for holder, _ in holders[id(parameter)]:
                cut_by.setdefault(modules[holder], cutting)
    held = [name for name, module in model.named_modules() if module in ignored]
    fates: dict[str, str | list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, COSTED):
            continue
        cutting = [g.name for g in cut_by.get(module, ()) if ratios[g.name] > 0]
        if cutting:
            fates[name] = cutting
        elif module in cut_by:
            fates[name] = f"the ratio of its group {cut_by[module][0].name!r} is 0"
        elif any(name == n or name.startswith(f"{n}.") for n in held):
            fates[name] = "in ignored_layers (or inside one of them)"
        elif module not in ran:
            fates[name] = "not called on example_inputs"
        else:
            fates[name] = reasons.get(module, "no group holds its output channels")
    return fates


def warn_idle_layers(model: nn.Module, layers: list, ignored: list) -> None:
    """Warn about conv and linear layers the example forward never called: no group can
    be found for them, so they stay whole whatever the ratios say (the experts of a
    ModuleList no example token was routed to, a branch the example does not take, a
    layer whose weight the model's code reads without calling it)."""
    ran = {layer.module for layer in layers}
    idle = [
        name
        for name, module in model.named_modules()
        if isinstance(module, COSTED) and module not in ran and module not in ignored
    ]
    if idle:
        warnings.warn(
            f"{len(idle)} conv/linear layers were not called on example_inputs, so they "
            f"are left whole: {idle[:6]}{' ...' if len(idle) > 6 else ''}. Give example "
            "inputs that run them (enough tokens to reach every expert, every branch) to "
            "prune them; a layer whose weight the model reads without calling it (Mamba's "
            "conv1d) stays whole whatever the inputs",
            UserWarning,
            stacklevel=3,
        )
