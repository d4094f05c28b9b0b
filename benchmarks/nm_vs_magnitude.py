"""Does learning an N:M mask matter? DTP N:M against one-shot magnitude N:M (the largest
|w| of each block) at the same pattern and with the same fine-tuning, on the digits CNN
(its first conv, one input channel, stays dense), over several seeds.

    python benchmarks/nm_vs_magnitude.py [--seeds 0 1 2] [--patterns 2:4 1:4] [--no-save]

Writes results/nm_vs_magnitude_cpu.md: accuracy after fine-tuning (and before it, right
after export) per method and pattern, mean and standard deviation over the seeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, environment

from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline.run import run

RECIPE = Path(__file__).resolve().parents[1] / "dtp_kernels" / "configs" / "digits.yaml"


def one_run(method: str, pattern: str, seed: int) -> dict:
    n, m = (int(v) for v in pattern.split(":"))
    overrides = [
        f"seed={seed}",
        f"prune.method={method}",
        "prune.granularity=n:m",
        f"prune.nm=[{n}, {m}]",
        f"prune.ratios={1 - n / m}",
        "prune.skip=[features.0]",
        "run.progress=false",
    ]
    return run(recipes.load(RECIPE, overrides))


def mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.2f} ± {100 * spread:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--patterns", nargs="+", default=["2:4", "1:4"])
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    env = environment(torch.device("cpu"))
    lines = [
        "# DTP N:M against one-shot magnitude N:M (`benchmarks/nm_vs_magnitude.py`)",
        "",
        f"{env['device']}; torch {env['torch']}; {env['date']}; digits CNN "
        f"(dtp_kernels/configs/digits.yaml: 12 epochs of pre-training, 12 of DTP for dtp, "
        f"12 of fine-tuning for both), seeds {args.seeds}; accuracy in % (mean ± std).",
        "",
        "| pattern | method | dense | after export | after fine-tuning |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for pattern in args.patterns:
        for method, label in (("l1", "magnitude (one shot)"), ("dtp", "DTP")):
            runs = [one_run(method, pattern, seed) for seed in args.seeds]
            lines.append(
                f"| {pattern} | {label} | {mean_std([r['dense_accuracy'] for r in runs])} "
                f"| {mean_std([r['accuracy_before_finetune'] for r in runs])} "
                f"| {mean_std([r['accuracy'] for r in runs])} |"
            )
            print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        (RESULTS / "nm_vs_magnitude_cpu.md").write_text(report)


if __name__ == "__main__":
    main()
