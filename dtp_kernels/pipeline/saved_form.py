"""How a run will save a pruned Hugging Face model, known before it trains.

The run saves a Hugging Face model with save_pretrained (the `pruned` directory that
from_pretrained reads) when its config can describe the pruned sizes, and to pruned.pt
(a pickled module: dtp_kernels.load_pruned) when it cannot: layers pruned to different
sizes, or sizes no field of the config holds (GPT-2 derives its head size from the
hidden size, so fewer heads cannot be written). The pruner predicts which from the
counts its masks keep (config_describes_export), so `dtp prune --plan` and the start of
a run say it, with the kinds of groups whose ratio of 0 would keep save_pretrained.
"""

from __future__ import annotations

import torch


def saved_form(pruner) -> dict | None:
    """Where the pruned model will go: {"saved": "pruned" or "pruned.pt", "whole_kinds":
    the kinds of groups ("heads", "mlp", ...) each of which, left whole with a ratio of 0,
    would let the config describe the rest (only when "pruned.pt")}. None for a model
    without a transformers config. Predicted from the current hard masks: under a learned
    budget, the counts at the start."""
    masks = pruner.hard_masks()
    described = pruner.config_describes_export(masks)
    if described is None:
        return None
    if described:
        return {"saved": "pruned", "whole_kinds": []}
    kinds = [row["kind"] for row in pruner.report()["groups"]]
    whole = []
    for kind in dict.fromkeys(kinds):
        trial = [torch.ones_like(m) if k == kind else m for k, m in zip(kinds, masks, strict=True)]
        if pruner.config_describes_export(trial):
            whole.append(kind)
    return {"saved": "pruned.pt", "whole_kinds": whole}


def saved_form_message(form: dict, learned: bool = False) -> str:
    """Why the pruned model will be saved to pruned.pt, not with save_pretrained, and
    which ratios of 0 would keep save_pretrained. `learned`: the counts are learned
    (budget "global" or "flops"), so the prediction holds for the counts at the start."""
    advice = (
        f"; a ratio of 0 for {' or '.join(repr(k) for k in form['whole_kinds'])} would keep "
        "save_pretrained"
        if form["whole_kinds"]
        else ""
    )
    return (
        "the pruned model's config cannot describe its sizes (layers pruned to different "
        "sizes, or a size no field of the config holds): it will be saved to pruned.pt "
        f"(load it with dtp_kernels.load_pruned), not with save_pretrained{advice}"
        + ("; predicted from the counts at the start, which DTP learns" if learned else "")
    )
