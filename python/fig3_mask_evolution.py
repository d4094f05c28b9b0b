"""Paper Fig. 3a: how the soft masks of sample filters evolve during DTP training (they
anneal to 0 or 1 by themselves). Runs the pipeline on digits; the plot is
<out>/plots/mask_evolution.png, with the per-epoch values in <out>/metrics.jsonl."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline.run import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.7)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--budget", default="layer", choices=["layer", "global", "flops"])
    parser.add_argument("--out", default="runs/fig3_mask_evolution")
    args = parser.parse_args()
    recipe = recipes.load(
        "dtp_kernels/configs/digits.yaml",
        [
            f"prune.ratios={args.ratio}",
            f"prune.epochs={args.epochs}",
            f"prune.budget={args.budget}",
            "finetune.epochs=2",
            "run.progress=false",
        ],
    )
    if args.budget == "flops":
        recipe["prune"]["flops_target"] = 1 - args.ratio
    summary = run(recipe, args.out)
    print(f"accuracy {summary['accuracy']:.2%}; plots in {Path(args.out) / 'plots'}")


if __name__ == "__main__":
    main()
