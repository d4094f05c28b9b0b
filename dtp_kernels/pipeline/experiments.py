"""The paper's experiments as recipes (dtp_kernels/configs/paper/) and the rows of its tables, and a
runner that repeats every row over seeds and reports the mean and standard deviation of
the accuracy after fine-tuning and before it (the paper's star point, Fig. 3b).

    dtp paper                                   # list the experiments
    dtp paper table1-resnet56 --seeds 0 1 2 --set data.root=DIR --set model.weights=FILE
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "paper"


@dataclass(frozen=True)
class Row:
    """One row of a table: its label, the recipe overrides that make it, and the
    accuracy (%) the paper reports for DTP (None where it reports none)."""

    label: str
    overrides: tuple[str, ...]
    paper: float | None = None


@dataclass(frozen=True)
class Experiment:
    name: str
    source: str  # where in the paper
    config: str  # file name in dtp_kernels/configs/paper/
    rows: tuple[Row, ...]

    @property
    def path(self) -> Path:
        return CONFIGS / self.config


def _resnet56(p: str, paper: float) -> Row:
    return Row(f"p={p}", (f"prune.ratios=[0, {p}, {p}, {p}]",), paper)


def _vgg19(p: str, paper: float) -> Row:
    return Row(f"p={p}", (f"prune.ratios='[0:0, 1-15:{p}]'",), paper)


def _mobilenet(data: str, ratio: float, paper: float) -> Row:
    classes = 10 if data == "cifar10" else 100
    root = "data/cifar-10-batches-py" if classes == 10 else "data/cifar-100-python"
    overrides = (
        f"data.name={data}",
        f"data.root={root}",
        f"model.num_classes={classes}",
        f"model.weights=weights/mobilenet_v2_{data}.pt",
        f"prune.ratios={ratio}",
    )
    return Row(f"{data} {ratio:.0%}", overrides, paper)


EXPERIMENTS = {
    e.name: e
    for e in (
        Experiment(
            "table1-resnet56",
            "Table 1, ResNet-56 on CIFAR-10",
            "table1_resnet56_cifar10.yaml",
            (
                _resnet56("0.5", 93.46),
                _resnet56("0.7", 92.46),
                _resnet56("0.9", 89.84),
                _resnet56("0.925", 88.03),
                _resnet56("0.95", 86.18),
            ),
        ),
        Experiment(
            "table1-vgg19",
            "Table 1, VGG-19 on CIFAR-100",
            "table1_vgg19_cifar100.yaml",
            (
                _vgg19("0.5", 71.56),
                _vgg19("0.6", 70.41),
                _vgg19("0.7", 67.74),
                _vgg19("0.8", 63.98),
                _vgg19("0.9", 57.21),
            ),
        ),
        Experiment(
            "table2-resnet50-unstructured",
            "Table 2, ResNet-50 on ImageNet, unstructured",
            "table2_resnet50_unstructured.yaml",
            (Row("82.7% of weights", (), 75.50),),
        ),
        Experiment(
            "table3-mobilenetv2",
            "Table 3, MobileNetV2 on CIFAR, global budget",
            "table3_mobilenetv2_cifar.yaml",
            (
                _mobilenet("cifar10", 0.6, 91.93),
                _mobilenet("cifar10", 0.8, 91.49),
                _mobilenet("cifar100", 0.6, 70.45),
                _mobilenet("cifar100", 0.8, 68.90),
            ),
        ),
        Experiment(
            "table4-resnet34",
            "Table 4, ResNet-34 on ImageNet",
            "table4_resnet34_imagenet.yaml",
            (Row("1.32x", (), 74.28),),
        ),
        Experiment(
            "table4-resnet50",
            "Table 4, ResNet-50 on ImageNet",
            "table4_resnet50_imagenet.yaml",
            (
                Row("2.31x", ("prune.ratios=[0, 0.6, 0.6, 0.6, 0.21]",), 75.55),
                Row("2.56x", ("prune.ratios=[0, 0.74, 0.74, 0.6, 0.21]",), 75.24),
                Row("3.06x", ("prune.ratios=[0, 0.68, 0.68, 0.68, 0.5]",), 74.26),
            ),
        ),
        Experiment(
            "table8-wrn26",
            "Table 8, WRN-26 on CIFAR-100, FLOPs budget",
            "table8_wrn26_flops_cifar100.yaml",
            (
                Row("40% FLOPs", ("prune.flops_target=0.4", "prune.ratios=0.37"), 78.63),
                Row("20% FLOPs", ("prune.flops_target=0.2", "prune.ratios=0.55"), 78.17),
            ),
        ),
    )
}


def row_folder(text: str) -> str:
    """The folder name of a row label (runs go to out/<row folder>/seed<s>)."""
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single seed)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), std


def run_experiment(
    name: str,
    seeds: list[int],
    out: str | Path,
    overrides: Sequence[str] = (),
    rows: list[str] | None = None,
) -> list[dict]:
    """Run every row (or those labelled in `rows`) of experiment `name` once per seed
    into out/<row>/seed<s>; a run whose summary.json exists is read, not rerun, and one
    with checkpoints resumes. Writes out/results.json and out/results.md; returns the
    per-row aggregates."""
    from . import recipe as recipes
    from .out_dir import has_checkpoints
    from .run import run

    if name not in EXPERIMENTS:
        raise UsageError(f"experiment {name!r}; known: {sorted(EXPERIMENTS)}")
    if not seeds:
        raise UsageError("--seeds: give at least one seed")
    experiment = EXPERIMENTS[name]
    chosen = [r for r in experiment.rows if rows is None or r.label in rows]
    if rows is not None and len(chosen) != len(rows):
        raise UsageError(
            f"--rows {rows}: the rows of {name} are {[r.label for r in experiment.rows]}"
        )
    out = Path(out)
    results = []
    for row in chosen:
        summaries: list[dict] = []
        for seed in seeds:
            where = out / row_folder(row.label) / f"seed{seed}"
            done = where / "summary.json"
            if not done.exists():
                recipe = recipes.load(experiment.path, [*row.overrides, f"seed={seed}", *overrides])
                # The row's own folder: resume what it checkpointed, else start it over.
                resume = has_checkpoints(where)
                run(recipe, where, resume=resume, overwrite=not resume and where.exists())
            if done.exists():  # rank 0 writes them
                summaries.append(json.loads(done.read_text()))
        if not summaries:
            continue
        accuracy = _mean_std([100 * s["accuracy"] for s in summaries])
        before = _mean_std([100 * s["accuracy_before_finetune"] for s in summaries])
        results.append(
            {
                "row": row.label,
                "seeds": list(seeds),
                "paper": row.paper,
                "accuracy_mean": accuracy[0],
                "accuracy_std": accuracy[1],
                "before_finetune_mean": before[0],
                "before_finetune_std": before[1],
                "dense_accuracy": 100 * statistics.fmean(s["dense_accuracy"] for s in summaries),
                "sparsity": summaries[0]["sparsity"],
                "speedup": summaries[0]["speedup"],
            }
        )
    if results:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "results.md").write_text(results_table(experiment, results))
    return results


def results_table(experiment: Experiment, results: list[dict]) -> str:
    """The aggregates as a markdown table, the paper's figure beside each row."""
    lines = [
        f"{experiment.source} ({experiment.config}), seeds {results[0]['seeds']}: "
        "top-1 accuracy (%), mean ± sample std",
        "",
        "| row | after fine-tuning | before fine-tuning | paper | dense | params pruned | "
        "FLOPs speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        paper = f"{r['paper']:.2f}" if r["paper"] is not None else "-"
        lines.append(
            f"| {r['row']} | {r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f} | "
            f"{r['before_finetune_mean']:.2f} ± {r['before_finetune_std']:.2f} | {paper} | "
            f"{r['dense_accuracy']:.2f} | {r['sparsity']:.2%} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def missing_inputs(name: str, overrides: Sequence[str] = ()) -> list[str]:
    """What experiment `name` needs that is not on disk (data directory, weights file),
    for each of its rows, in words."""
    from . import recipe as recipes

    experiment, missing = EXPERIMENTS[name], []
    for row in experiment.rows:
        loaded = recipes.load(experiment.path, [*row.overrides, *overrides])
        root, weights = loaded["data"]["root"], loaded["model"]["weights"]
        if root is not None and not Path(root).exists():
            missing.append(f"data.root = {root} ({loaded['data']['name']})")
        if weights not in (None, "random") and not Path(weights).is_file():
            missing.append(f"model.weights = {weights}")
    return list(dict.fromkeys(missing))


def table_script(names: list[str], argv: list[str] | None = None) -> int:
    """Main of the python/table*.py scripts: run the experiments `names` over --seeds, or,
    while their data or weights are missing, print the commands and what to provide."""
    import argparse
    import shlex

    from ..cli import main as dtp

    parser = argparse.ArgumentParser(description=", ".join(EXPERIMENTS[n].source for n in names))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="runs/paper")
    args = parser.parse_args(argv)
    commands = []
    for name in names:
        sets = [a for s in args.set for a in ("--set", s)]
        seeds = [str(s) for s in args.seeds]
        commands.append(["paper", name, "--seeds", *seeds, "--out", f"{args.out}/{name}", *sets])
    missing = [m for name in names for m in missing_inputs(name, args.set)]
    if missing:
        print("Needs (give them with --set KEY=VALUE):")
        for item in dict.fromkeys(missing):
            print(f"  {item}")
        print("The commands (python -m dtp_kernels ...):")
        for argv_ in commands:
            print(f"python -m dtp_kernels {shlex.join(argv_)}")
        return 0
    return max(dtp(argv_) for argv_ in commands)
