"""Whether a pruned Hugging Face model's config will describe it, said before training.

export() writes the kept sizes into a transformers model's config when a model built
from it has the exported shapes; where none can (layers pruned to different sizes, or
sizes no field holds: GPT-2 derives its head size from the hidden size, so fewer heads
cannot be written), the exported model must be saved with save_pruned, not
save_pretrained. The pruner predicts which from the counts its masks keep
(config_describes_export). For a config that cannot, the forecast finds the groups to
leave whole: it tries each kind of group of each part of the model (a composite model's
vision tower and language model hold configs of their own) pruned alone, and leaves
whole the kinds a config cannot describe even alone, when the config then describes the
rest. `dtp prune --plan`, the start of a `dtp prune` run and the Hugging Face Trainer
callback say it before any training, with the ratios that keep save_pretrained.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .hf_config import part_names
from .ratios import KINDS, with_zeros


def config_forecast(pruner) -> dict | None:
    """{"describes": whether the export's config will describe it; where it will not,
    "whole": the names of the groups to leave whole for a config that does ([] where no
    choice of whole kinds gives one), and "ratios": the ratios that leave them whole and
    prune the rest as asked (None without advice, or for ratios per stage or layer)}.
    None for a model without a transformers config. From the current hard masks: under a
    learned budget, the counts learned so far."""
    masks = pruner.hard_masks()
    described = pruner.config_describes_export(masks)
    if described is None:
        return None
    if described:
        return {"describes": True, "whole": [], "ratios": None}
    rows = pruner.report()["groups"]
    parts = part_names(pruner.model)
    units: dict[tuple[str, str], list[int]] = {}  # (part, kind) -> its groups' indices
    for i, row in enumerate(rows):
        part = next((p for p in parts if row["name"].startswith(f"{p}.")), "")
        units.setdefault((part, row["kind"]), []).append(i)

    def describes_with(pruned: list[tuple[str, str]]) -> bool:  # the other units whole
        cut = {i for unit in pruned for i in units[unit]}
        trial = [m if i in cut else torch.ones_like(m) for i, m in enumerate(masks)]
        return bool(pruner.config_describes_export(trial))

    whole = [unit for unit in units if not describes_with([unit])]
    rest = [unit for unit in units if unit not in whole]
    if not whole or not rest or not describes_with(rest):
        return {"describes": False, "whole": [], "ratios": None}
    names = [rows[i]["name"] for unit in whole for i in units[unit]]
    kinds = list(dict.fromkeys(kind for _, kind in whole))
    everywhere = all(unit in whole for unit in units if unit[1] in kinds)  # whole kinds
    asked = pruner._asked_ratios
    advice = _per_kind(asked, [row["kind"] for row in rows], kinds) if everywhere else None
    return {"describes": False, "whole": names, "ratios": advice or with_zeros(asked, names)}


def _per_kind(asked, present: list[str], whole_kinds: list[str]) -> dict | None:
    """The asked ratios per kind with 0 for `whole_kinds` (GPT-2's heads at 0.5:
    {"heads": 0, "mlp": 0.5}), where they were asked as a float or by kind alone; else
    None (names and patterns: the whole groups are named instead)."""
    if isinstance(asked, (int, float)) and not isinstance(asked, bool):
        return {kind: 0 if kind in whole_kinds else asked for kind in dict.fromkeys(present)}
    if isinstance(asked, Mapping) and all(key in KINDS for key in asked):
        return {**asked, **dict.fromkeys(whole_kinds, 0)}
    return None


def forecast_message(forecast: dict, learned: bool = False) -> str:
    """Why the exported model is to be saved with save_pruned, not save_pretrained, and
    the ratios that would keep save_pretrained. `learned`: the counts are learned
    (budget "global" or "flops"), so the forecast holds for the counts at the start."""
    return (
        "the pruned model's config will not describe its sizes (layers pruned to different "
        "sizes, or a size no field of the config holds), so save_pretrained's files would "
        "not load it: it is to be saved with dtp_kernels.save_pruned"
        + (f"; ratios={forecast['ratios']} keep save_pretrained" if forecast["ratios"] else "")
        + ("; forecast from the counts at the start, which DTP learns" if learned else "")
    )
