"""Does learning an N:M mask matter? DTP N:M against one-shot magnitude N:M (the largest
|w| of each block) at the same pattern and with the same fine-tuning, over several seeds,
DTP with learned scores started at |w| (the default) and with the weights' current |w|
as scores (`scores="magnitude"`):

- `--model digits`: the digits CNN through `dtp prune` (its first conv, one input
  channel, stays dense); accuracy;
- `--model llama`: the small byte-level Llama of `make demo-transformers` (every Linear
  of its decoder layers, the output head stays dense); held-out perplexity. DTP trains
  150 steps with soft masks and fine-tunes 150 after export; magnitude fine-tunes 300.

    python benchmarks/nm_vs_magnitude.py [--model digits|llama] [--seeds 0 1 2]
        [--patterns 2:4 1:4] [--no-save]

Writes results/nm_vs_magnitude_cpu.md (digits) or nm_vs_magnitude_llama_cpu.md: the
metric before fine-tuning (right after export) and after it, per method and pattern,
mean and standard deviation over the seeds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, environment

from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline.run import run, zero_pattern
from dtp_kernels.pipeline.train import hold_at_zero
from dtp_kernels.pruning import DTPPruner, prepare
from dtp_kernels.transformer_demo import llama_task

RECIPE = Path(__file__).resolve().parents[1] / "dtp_kernels" / "configs" / "digits.yaml"
LLAMA_STEPS = (600, 150, 150)  # pre-training, DTP, fine-tuning (as the transformer demo)
METHODS = (
    ("l1", "magnitude (one shot)"),
    ("dtp", "DTP"),  # learned scores started at |w| (the default)
    ("dtp-magnitude", "DTP, scores = current abs(w)"),  # scores="magnitude"
)


def parse_pattern(pattern: str) -> tuple[int, int]:
    n, m = (int(v) for v in pattern.split(":"))
    return n, m


def digits_runs(pattern: str, seeds: list[int]) -> dict[str, list[dict]]:
    """Per method, (dense, after export, after fine-tuning) accuracies of `dtp prune`
    per seed."""
    n, m = parse_pattern(pattern)
    runs: dict[str, list[dict]] = {method: [] for method, _ in METHODS}
    for method, _ in METHODS:
        for seed in seeds:
            overrides = [
                f"seed={seed}",
                f"prune.method={'dtp' if method.startswith('dtp') else method}",
                f"prune.scores={'magnitude' if method == 'dtp-magnitude' else 'learned'}",
                "prune.granularity=n:m",
                f"prune.nm=[{n}, {m}]",
                f"prune.ratios={1 - n / m}",
                "prune.skip=[features.0]",
                "run.progress=false",
            ]
            result = run(recipes.load(RECIPE, overrides))
            runs[method].append(
                {
                    "dense": result["dense_accuracy"],
                    "export": result["accuracy_before_finetune"],
                    "final": result["accuracy"],
                }
            )
    return runs


def llama_runs(pattern: str, seeds: list[int]) -> dict[str, list[dict]]:
    """Per method, (dense, after export, after fine-tuning) perplexities of the small
    Llama per seed; both methods start from the same pre-trained model and draw the same
    training windows after it."""
    n, m = parse_pattern(pattern)
    runs: dict[str, list[dict]] = {method: [] for method, _ in METHODS}
    for seed in seeds:
        task = llama_task(seed)
        task.train_steps(task.model, task.new_optimizer(task.model), LLAMA_STEPS[0])
        dense = task.perplexity(task.model)
        windows_from = task.generator.get_state()
        for method, _ in METHODS:
            task.generator.set_state(windows_from)
            model = copy.deepcopy(task.model)
            options = {"granularity": "n:m", "nm": (n, m), "ignored_layers": [model.lm_head]}
            if method.startswith("dtp"):
                optimizer = task.new_optimizer(model)
                scores = "magnitude" if method == "dtp-magnitude" else "learned"
                pruner = prepare(
                    model, optimizer, task.example, 1 - n / m, scores=scores, **options
                )
                task.train_steps(model, optimizer, LLAMA_STEPS[1])
                small, steps = pruner.export(), LLAMA_STEPS[2]
            else:  # the untrained pruner's masks: the largest |w| of every block
                small = DTPPruner(model, task.example, 1 - n / m, **options).export()
                steps = LLAMA_STEPS[1] + LLAMA_STEPS[2]
            after_export = task.perplexity(small)
            optimizer = task.new_optimizer(small)
            hold_at_zero(optimizer, zero_pattern(small))  # the pattern through fine-tuning
            task.train_steps(small, optimizer, steps)
            final = task.perplexity(small)
            runs[method].append({"dense": dense, "export": after_export, "final": final})
    return runs


def mean_std(values: list[float], scale: float) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.fmean(values):.2f} ± {scale * spread:.2f}"


MODELS = {
    "digits": (
        digits_runs,
        100.0,
        "digits CNN (dtp_kernels/configs/digits.yaml: 12 epochs of pre-training, 12 of DTP "
        "for dtp, 12 of fine-tuning for both); accuracy in %",
        "nm_vs_magnitude_cpu.md",
    ),
    "llama": (
        llama_runs,
        1.0,
        "small Llama of dtp_kernels/transformer_demo.py (2 layers, hidden 64, byte-level, "
        f"stdlib source; {LLAMA_STEPS[0]} steps of pre-training; DTP {LLAMA_STEPS[1]} steps "
        f"with soft masks + {LLAMA_STEPS[2]} of fine-tuning, magnitude "
        f"{LLAMA_STEPS[1] + LLAMA_STEPS[2]} of fine-tuning; lm_head dense); held-out "
        "perplexity (lower is better)",
        "nm_vs_magnitude_llama_cpu.md",
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="digits")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--patterns", nargs="+", default=["2:4", "1:4"])
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    runs_of, scale, what, filename = MODELS[args.model]
    env = environment(torch.device("cpu"))
    lines = [
        "# DTP N:M against one-shot magnitude N:M (`benchmarks/nm_vs_magnitude.py`)",
        "",
        f"{env['device']}; torch {env['torch']}; {env['date']}; {what}; seeds {args.seeds} "
        "(mean ± std).",
        "",
        "| pattern | method | dense | after export | after fine-tuning |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for pattern in args.patterns:
        per_method = runs_of(pattern, args.seeds)
        for method, label in METHODS:
            runs = per_method[method]
            keys = ("dense", "export", "final")
            cells = [mean_std([r[key] for r in runs], scale) for key in keys]
            lines.append(f"| {pattern} | {label} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        (RESULTS / filename).write_text(report)


if __name__ == "__main__":
    main()
