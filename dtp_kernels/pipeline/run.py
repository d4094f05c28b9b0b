"""One pruning run: optional dense pre-training, pruning (DTP soft-mask training, or a
one-shot baseline), export, fine-tuning and evaluation, from a recipe."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from torch import nn

from ..models import get_model
from ..pruning import DTPPruner, L1Pruner, RandomPruner, save_pruned
from ..pruning.flops import count_flops, count_params
from . import data as datasets
from . import distributed, plots
from .train import Checkpointing, MetricsLog, RunOptions, evaluate, train

METHODS = ("dtp", "l1", "random")


def build_data(recipe: dict):
    spec = recipe["data"]
    if spec["name"] == "digits":
        train_set, test_set = datasets.digits(seed=recipe["seed"])
    elif spec["name"] in ("cifar10", "cifar100"):
        train_set, test_set = datasets.cifar(spec["root"], spec["name"])
    elif spec["name"] == "imagefolder":
        train_set, test_set = datasets.image_folder(spec["root"])
    else:
        raise ValueError(
            f"data.name = {spec['name']!r}; allowed: digits, cifar10, cifar100, imagefolder"
        )
    return datasets.loaders(train_set, test_set, spec["batch_size"], recipe["seed"])


def stage_checkpoint(
    checkpoints: Path | None, recipe: dict, stage: str, resume: bool
) -> Checkpointing | None:
    """Checkpoint settings of one stage: its file, and what a resumed file must match."""
    if checkpoints is None:
        return None
    prune = recipe["prune"]
    meta = {
        "stage": stage, "model": recipe["model"]["name"], "method": prune["method"],
        "ratios": str(prune["ratios"]), "budget": prune["budget"], "seed": recipe["seed"],
    }  # fmt: skip
    return Checkpointing(checkpoints / f"{stage}.pt", meta, resume)


def prune_and_finetune(
    dense: nn.Module,
    recipe: dict,
    train_loader,
    test_loader,
    log: MetricsLog,
    checkpoints: Path | None = None,
    resume: bool = False,
    options: RunOptions | None = None,
) -> dict:
    """Prune a copy of `dense` per recipe["prune"], fine-tune it; return the summary."""
    settings = recipe["prune"]
    method = settings["method"]
    if method not in METHODS:
        raise ValueError(f"prune.method = {method!r}; allowed: {list(METHODS)}")
    model = copy.deepcopy(dense)
    example = next(iter(test_loader))[0][:1]
    times = {}
    start = time.perf_counter()
    if method == "dtp":
        pruner = DTPPruner(model, example, settings["ratios"], budget=settings["budget"],
                           eps=settings["eps"], iters=settings["iters"])  # fmt: skip

        def trace(epoch: int) -> None:  # soft masks of sample filters, for the Fig. 3a plot
            log.write(stage="mask-trace", epoch=epoch, masks=sample_masks(pruner))

        trace(-1)
        result = train(model, train_loader, test_loader, settings, log, f"dtp-{settings['ratios']}",
                       pruner=pruner, flops_target=settings.get("flops_target"),
                       checkpoint=stage_checkpoint(checkpoints, recipe, "dtp", resume),
                       options=options, on_epoch=trace)  # fmt: skip
    else:
        cls = L1Pruner if method == "l1" else RandomPruner
        pruner = cls(model, example, settings["ratios"], budget=settings["budget"])
    times["prune"] = time.perf_counter() - start
    groups = pruner.report()["groups"]
    start = time.perf_counter()
    pruned = pruner.export()
    times["export"] = time.perf_counter() - start
    saving = stage_checkpoint(checkpoints, recipe, "finetune", resume)
    result = train(pruned, train_loader, test_loader, recipe["finetune"], log,
                   f"finetune-{method}-{settings['ratios']}", checkpoint=saving,
                   options=options)  # fmt: skip
    times["finetune"] = result["seconds"]
    base_params, base_flops = count_params(dense), count_flops(dense, example)
    params, flops = count_params(pruned), count_flops(pruned, example)
    return {
        "method": method,
        "ratios": settings["ratios"],
        "accuracy": evaluate(pruned, test_loader),
        "params": params,
        "flops": flops,
        "sparsity": 1 - params / base_params,
        "speedup": base_flops / flops,
        "seconds": times,
        "groups": groups,
        "model": pruned,
    }


SAMPLE_GROUPS, SAMPLE_FILTERS = 6, 4


def sample_masks(pruner: DTPPruner) -> dict[str, list[float]]:
    """The current soft masks of the first filters of the first groups."""
    masks = pruner.channel_scores().float().cpu().split(pruner.sizes)
    return {group.name: [round(float(v), 6) for v in mask[:SAMPLE_FILTERS]]
            for group, mask in zip(pruner.groups[:SAMPLE_GROUPS], masks, strict=False)}  # fmt: skip


def write_plots(summary: dict, rows: list[dict], where: Path, recipe: dict) -> list[Path]:
    """Fig. 3a (from the mask-trace rows of a DTP run) and Fig. 7 as PNG files."""
    where.mkdir(parents=True, exist_ok=True)
    prune = recipe["prune"]
    label = f"{recipe['model']['name']}, {prune['method']} {prune['ratios']} ({prune['budget']})"
    written = []
    traces = [r for r in rows if r["stage"] == "mask-trace"]
    if traces:
        by_group = {name: [r["masks"][name] for r in traces] for name in traces[0]["masks"]}
        plots.mask_evolution(by_group, where / "mask_evolution.png",
                             f"soft masks of sample filters, {label}")  # fmt: skip
        written.append(where / "mask_evolution.png")
    plots.learned_sparsity(summary["groups"], where / "sparsity.png",
                           f"kept fraction per group, {label}")  # fmt: skip
    written.append(where / "sparsity.png")
    return written


def run(recipe: dict, out_dir: str | Path | None = None, resume: bool = False) -> dict:
    """The whole pipeline; writes metrics.jsonl, summary.json and pruned.pt to out_dir,
    and a checkpoint per stage to out_dir/checkpoints after every epoch. resume=True
    continues from those checkpoints (finished stages are restored, not rerun) and ends
    bitwise where an uninterrupted run ends."""
    distributed.init_from_env()  # under torchrun: one process per GPU (or CPU rank)
    torch.manual_seed(recipe["seed"])
    out = Path(out_dir) if out_dir is not None else None
    if resume and out is None:
        raise ValueError("resume needs the output directory of the run to resume (--out)")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    checkpoints = out / "checkpoints" if out is not None else None
    settings = recipe["run"]
    options = RunOptions(settings["amp"], settings["channels_last"], settings["progress"])
    writes = out is not None and distributed.is_main()  # rank 0 writes the files
    tensorboard = out / "tensorboard" if writes and settings["tensorboard"] else None
    log = MetricsLog(out / "metrics.jsonl" if writes else None, tensorboard)
    train_loader, test_loader = build_data(recipe)
    model = get_model(recipe["model"]["name"], recipe["model"]["num_classes"])
    if recipe["pretrain"]["epochs"]:
        saving = stage_checkpoint(checkpoints, recipe, "pretrain", resume)
        dense = train(model, train_loader, test_loader, recipe["pretrain"], log, "pretrain",
                      checkpoint=saving, options=options)  # fmt: skip
    else:
        dense = {"seconds": 0.0, "accuracy": evaluate(model, test_loader, options)}
    summary = prune_and_finetune(model, recipe, train_loader, test_loader, log, checkpoints,
                                 resume, options)  # fmt: skip
    summary["dense_accuracy"] = dense["accuracy"]
    summary["seconds"]["pretrain"] = dense["seconds"]
    if writes:
        architecture = {k: recipe["model"][k] for k in ("name", "num_classes")}
        metadata = {"method": summary["method"], "ratios": str(summary["ratios"])}
        save_pruned(out / "pruned.pt", summary["model"], architecture, metadata)
        if settings["plots"]:
            write_plots(summary, log.rows, out / "plots", recipe)
        printable = {k: v for k, v in summary.items() if k != "model"}
        (out / "summary.json").write_text(json.dumps(printable, indent=2))
    return summary
