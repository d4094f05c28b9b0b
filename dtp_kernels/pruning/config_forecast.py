"""Whether a pruned Hugging Face model's config will describe it, said before training.

export() writes the kept sizes into a transformers model's config when a model built
from it has the exported shapes; where none can (layers pruned to different sizes, or
sizes no field holds: GPT-2 derives its head size from the hidden size, so fewer heads
cannot be written), the exported model must be saved with save_pruned, not
save_pretrained. The pruner predicts which from the counts its masks keep
(config_describes_export). For a config that cannot, the forecast finds the groups to
leave whole: it tries each kind of group pruned alone and, for a kind no config then
describes, each of its units (its groups at one place in every layer:
"model.layers.*.self_attn" heads, BERT's pooler) alone, or else the kind less one unit,
and leaves whole what a config cannot describe, when the config then describes the rest.
`dtp prune --plan`, the start of a `dtp prune` run and the Hugging Face Trainer
callback say it before any training, with the ratios that keep save_pretrained.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .ratios import KINDS, with_zeros


def config_forecast(pruner) -> dict | None:
    """{"describes": whether the export's config will describe it; where it will not,
    "whole": the names of the groups to leave whole for a config that does ([] where
    none is found), and "ratios": the ratios that leave them whole and
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
    kinds = [row["kind"] for row in rows]
    mask_of = getattr(pruner, "mask_of", list(range(len(rows))))

    def tied(indices: set[int]) -> set[int]:  # with the groups sharing their masks
        sources = {mask_of[i] for i in indices}
        return {i for i in range(len(rows)) if mask_of[i] in sources}

    def describes_with(cut: set[int]) -> bool:  # the groups `cut` pruned, the others whole
        cut = tied(cut)  # a tie set's groups are pruned or whole together
        trial = [m if i in cut else torch.ones_like(m) for i, m in enumerate(masks)]
        return bool(pruner.config_describes_export(trial))

    # a kind pruned alone, else each of its units (its groups at one place in every
    # layer): a kind's units may need each other (SigLIP's encoder and head MLPs share
    # intermediate_size), a kind may hold one no field describes (BERT's pooler); where
    # no unit is described alone, the kind less one unit (MobileBERT's four MLPs per
    # layer share intermediate_size; its attention's bottleneck has no field of its own)
    cut: set[int] = set()
    whole_kinds = []
    for kind in dict.fromkeys(kinds):
        members = {i for i, k in enumerate(kinds) if k == kind}
        if describes_with(members):
            cut |= members
            continue
        units: dict[str, set[int]] = {}
        for i in members:
            units.setdefault(LAYER_NUMBER.sub(".*", rows[i]["name"]), set()).add(i)
        fits = [unit for unit in units.values() if describes_with(unit)]
        if not fits and len(units) > 2:  # (of two: the other one, tried alone)
            fits = [members - unit for unit in units.values() if describes_with(members - unit)]
            fits = fits[:1]
        cut |= set().union(*fits)
        if not fits:
            whole_kinds.append(kind)
    cut = tied(cut)
    if not cut or not describes_with(cut):
        return {"describes": False, "whole": [], "ratios": None}
    whole = [i for i in range(len(rows)) if i not in cut]
    names = [rows[i]["name"] for i in whole]
    named = [rows[i]["name"] for i in whole if kinds[i] not in whole_kinds]
    advice = _advice(pruner._asked_ratios, kinds, whole_kinds, named, names)
    return {"describes": False, "whole": names, "ratios": advice}


# a module name's numbered parts (layers, experts): one unit of the forecast over them
LAYER_NUMBER = re.compile(r"\.\d+(?=\.|$)")


def _advice(
    asked, kinds: list[str], whole_kinds: list[str], named: list[str], names: list[str]
) -> dict | None:
    """The ratios that leave the groups `names` whole and prune the rest as asked. Asked
    as a float or by kind alone: per kind, 0 for the kinds whole everywhere (GPT-2's
    heads at 0.5: {"heads": 0, "mlp": 0.5}), with a 0 for each other whole group's name
    (`named`; a name beats a kind); else the asked ratios with a 0 for every name."""
    if isinstance(asked, (int, float)) and not isinstance(asked, bool):
        if not whole_kinds:
            return {"*": asked, **dict.fromkeys(named, 0)}
        per_kind = {kind: 0 if kind in whole_kinds else asked for kind in dict.fromkeys(kinds)}
        return {**per_kind, **dict.fromkeys(named, 0)}
    if isinstance(asked, Mapping) and all(key in KINDS for key in asked):
        return {**asked, **dict.fromkeys(whole_kinds, 0), **dict.fromkeys(named, 0)}
    return with_zeros(asked, names)


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
