"""Accuracy against the pruning ratio: DTP against L1 one-shot on the digits CNN, the
same kept counts and fine-tuning epochs for both."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.demo import digits_comparison
from dtp_kernels.pipeline.plots import accuracy_vs_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="0.3,0.5,0.7,0.8,0.9")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default="runs/accuracy_vs_ratio")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ratios = [float(r) for r in args.ratios.split(",")]
    variants = [{"method": m, "ratios": r} for r in ratios for m in ("dtp", "l1")]
    rows = digits_comparison(args.epochs, variants=variants)
    table = [
        {"method": r["method"], "ratio": float(r["ratio"]), "accuracy": r["accuracy"]} for r in rows
    ]
    for row in table:
        print(f"{row['method']:>6} {row['ratio']:>5.0%} {row['accuracy']:>8.2%}")
    (out / "accuracy_vs_ratio.json").write_text(json.dumps(table, indent=2))
    accuracy_vs_ratio(
        [r for r in table if r["method"] != "dense"],
        out / "accuracy_vs_ratio.png",
        "digits CNN: DTP against L1",
    )
    print(f"plot: {out / 'accuracy_vs_ratio.png'}")


if __name__ == "__main__":
    main()
