"""Prune the smallest architecture of every timm model module at a float ratio and
check each export (`python benchmarks/timm_prune_check.py [--module NAME ...]`).

Every module of timm's registry (a family: `resnet`, `vision_transformer`, `byobnet`, ...)
is represented by its architecture of the fewest parameters (counted on the meta device;
timm's `test_*` models left out), built with random weights and 5 classes, BN statistics
drawn away from the identity and random scores, and run on two images of its default
input size. A refusal that names the ratios or the layers to leave whole, or says that
prune_coupled=True would find groups, is followed as a user would (_prune_sweep.py).
Export error: the export's largest difference from the hard-masked model, relative to
its largest output. Params = report: the export's parameters against the report's.
Whole = listed: whether the layers the export leaves their shapes are the ones
pruner.left_whole lists. A refused row says the first refusal's reason, then the last's.
An error other than a refusal is recorded as
`failed` with its type: a bug to look at.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
import warnings
from pathlib import Path

import timm
import torch

# the checkout's dtp_kernels and the tests' helpers, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _harness import RESULTS, environment
from _prune_sweep import Refused, first_words, prune_as_refusals_say, row_within, table

from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.group_kinds import kind_of
from utils import drawn_statistics, layer_shapes, whole_as_listed

LARGEST = 90e6  # parameters of a module's smallest architecture
SECONDS = 300  # per architecture
CLASSES = 5


def smallest_per_module(modules: list[str]) -> dict[str, tuple[str, int]]:
    """Per timm module, its architecture of the fewest parameters and their number (a
    module none of whose architectures builds on the meta device is left out)."""
    chosen = {}
    for module in modules:
        sizes = {}
        for name in timm.list_models(module=module, exclude_filters=["test_*"]):
            try:
                with torch.device("meta"):
                    model = timm.create_model(name, num_classes=CLASSES)
            except Exception:  # one needing a real device to build
                continue
            sizes[name] = sum(p.numel() for p in model.parameters())
        if sizes:
            name = min(sizes, key=lambda n: (sizes[n], n))
            chosen[module] = (name, sizes[name])
    return chosen


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The architecture with random weights, BN statistics away from the identity, its
    classifier's weights large enough that every kept channel shows, and two images."""
    torch.manual_seed(0)
    model = drawn_statistics(timm.create_model(name, num_classes=CLASSES)).eval()
    for head in model.modules():
        if isinstance(head, torch.nn.Linear) and head.out_features == CLASSES:
            torch.nn.init.normal_(head.weight, std=0.1)
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))
    return model, torch.randn(2, *size, generator=torch.Generator().manual_seed(1))


def check(module: str, name: str, ratio: float) -> list[str]:
    """The table row of one architecture."""
    try:
        model, x = build(name)
        with torch.no_grad():
            model(x)
    except Exception as error:
        return _unpruned(module, name, "not built", type(error).__name__)
    shapes = layer_shapes(model)
    try:
        pruned = prune_as_refusals_say(model, (x[:1],), ratio, lambda m: m(x))
    except Exception as error:  # not a refusal: a bug
        return _unpruned(module, name, "failed", f"{type(error).__name__}: {first_words(error)}")
    if isinstance(pruned, Refused):
        return _unpruned(module, name, "refused", pruned.why())
    with torch.no_grad():
        got = pruned.exported(x)
    report = pruned.pruner.report()
    error = float((got - pruned.want).abs().max() / pruned.want.abs().max().clamp_min(1e-12))
    counts: dict[str, int] = {}
    for group in pruned.pruner.groups:
        counts[kind_of(group)] = counts.get(kind_of(group), 0) + 1
    return [
        module,
        name,
        pruned.result,
        ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())),
        f"{report['flops_before'] / report['flops_after']:.2f}x",
        f"{report['params_before'] / report['params_after']:.2f}x",
        f"{error:.1e}",
        "yes" if count_params(pruned.exported) == report["params_after"] else "NO",
        "yes" if whole_as_listed(pruned.exported, shapes, pruned.pruner.left_whole) else "NO",
        _asked(pruned.ratios, pruned.ignored, pruned.coupled),
    ]


def _asked(ratios: float | dict, ignored: list[str], coupled: bool) -> str:
    """What the refusals had asked: prune_coupled=True, the layers at 0 and the layers
    left whole, the first three of each by name."""
    said = ["prune_coupled=True"] if coupled else []
    if isinstance(ratios, dict):
        zeros = [name for name, value in ratios.items() if value == 0]
        said.append(f"{len(zeros)} at 0: {', '.join(zeros[:3])}{', ...' * (len(zeros) > 3)}")
    if ignored:
        said.append(f"{len(ignored)} left whole: {', '.join(ignored[:3])}")
    return "; ".join(said)


def _unpruned(module: str, name: str, result: str, why: str) -> list[str]:
    return [module, name, result, "", "", "", "", "", "", why]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", nargs="*", help="timm modules (default: every one)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    chosen = smallest_per_module(args.module or timm.list_modules())
    rows = []
    for module, (name, params) in chosen.items():
        start = time.perf_counter()
        if params > LARGEST:
            row = _unpruned(module, name, "skipped", f"{params / 1e6:.0f}M parameters")
        else:
            expired = _unpruned(module, name, "timed out", f"over {SECONDS} s")
            row = row_within(SECONDS, expired, check, module, name, args.ratio)
        rows.append(row)
        print(f"{' | '.join(row)} ({time.perf_counter() - start:.1f} s)", flush=True)
    env = environment(torch.device("cpu"))
    header = [
        "module",
        "model",
        "result",
        "groups",
        "FLOPs fewer",
        "params fewer",
        "export error",
        "params = report",
        "whole = listed",
        "why",
    ]
    lines = [
        "# Every timm model module's smallest architecture pruned and exported "
        "(`benchmarks/timm_prune_check.py`)",
        "",
        f"{env['device']}; torch {env['torch']}, timm {timm.__version__}, torch-pruning "
        f"{importlib.metadata.version('torch-pruning')}; {env['date']}; float ratio "
        f"{args.ratio}, random weights, BN statistics and scores, {CLASSES} classes, two "
        "images of the model's default input size. Export error: largest difference from "
        "the hard-masked model, relative to its largest output. Params = report: the "
        "export's parameters against the pruner's report. Whole = listed: whether the "
        "layers the export leaves their shapes are the ones pruner.left_whole lists. A "
        "refusal naming the ratios or the layers to leave whole, or prune_coupled=True, "
        "is followed as a user would (why: what was asked then). Architectures over "
        f"{LARGEST / 1e6:.0f}M parameters are skipped.",
        "",
        *table(header, rows, 2, "modules"),
    ]
    report = "\n".join(lines) + "\n"
    if args.no_save:
        print(report)
    else:
        (RESULTS / "timm_prune_check_cpu.md").write_text(report)


if __name__ == "__main__":
    main()
