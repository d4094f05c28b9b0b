"""Whether a pruned Hugging Face model's config will describe it, said before training.

export() writes the kept sizes into a transformers model's config when a model built
from it has the exported shapes; where none can (layers pruned to different sizes, or
sizes no field holds: GPT-2 derives its head size from the hidden size, so fewer heads
cannot be written), the exported model must be saved with save_pruned, not
save_pretrained. The pruner predicts which from the counts its masks keep
(config_describes_export), and for a config that cannot, the kinds of groups whose ratio
of 0 would let it: `dtp prune --plan`, the start of a `dtp prune` run and the Trainer
callback say it before any training.
"""

from __future__ import annotations

import torch


def config_forecast(pruner) -> dict | None:
    """{"describes": whether the export's config will describe it, "whole_kinds": the
    kinds of groups ("heads", "mlp", ...) each of which, left whole with a ratio of 0,
    would let the config describe the rest (only where it will not)}. None for a model
    without a transformers config. From the current hard masks: under a learned budget,
    the counts learned so far."""
    masks = pruner.hard_masks()
    described = pruner.config_describes_export(masks)
    if described is None:
        return None
    kinds = [row["kind"] for row in pruner.report()["groups"]]
    whole = []
    for kind in [] if described else dict.fromkeys(kinds):
        trial = [torch.ones_like(m) if k == kind else m for k, m in zip(kinds, masks, strict=True)]
        if pruner.config_describes_export(trial):
            whole.append(kind)
    return {"describes": described, "whole_kinds": whole}


def forecast_message(forecast: dict, learned: bool = False) -> str:
    """Why the exported model is to be saved with save_pruned, not save_pretrained, and
    which ratios of 0 would keep save_pretrained. `learned`: the counts are learned
    (budget "global" or "flops"), so the forecast holds for the counts at the start."""
    kinds = " or ".join(repr(kind) for kind in forecast["whole_kinds"])
    return (
        "the pruned model's config will not describe its sizes (layers pruned to different "
        "sizes, or a size no field of the config holds), so save_pretrained's files would "
        "not load it: it is to be saved with dtp_kernels.save_pruned"
        + (f"; a ratio of 0 for {kinds} would keep save_pretrained" if kinds else "")
        + ("; forecast from the counts at the start, which DTP learns" if learned else "")
    )
