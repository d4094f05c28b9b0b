"""Paper Fig. 4: accuracy and training time against the number of Sinkhorn iterations
per step. DTP's one warm-started step against 2 to 50 iterations (the converged soft
top-k regime), digits CNN at 90% of its filters pruned, the same epochs for each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.demo import digits_comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", default="1,2,5,10,50")
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default="runs/fig4_iterations")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    iters = [int(i) for i in args.iters.split(",")]
    variants = [{"method": "dtp", "ratios": args.ratio, "iters": i} for i in iters]
    rows = digits_comparison(args.epochs, variants=variants)[1:]
    table = [
        {"iters": r["iters"], "accuracy": r["accuracy"], "prune_seconds": r["seconds"]["prune"]}
        for r in rows
    ]
    print(f"{'iters':>6} {'accuracy':>9} {'DTP stage s':>12}")
    for row in table:
        print(f"{row['iters']:>6} {row['accuracy']:>9.2%} {row['prune_seconds']:>12.1f}")
    (out / "fig4_iterations.json").write_text(json.dumps(table, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, left = plt.subplots(figsize=(5.5, 3.5))
    xs = [r["iters"] for r in table]
    left.semilogx(xs, [100 * r["accuracy"] for r in table], "o-", color="C0")
    left.set_xlabel("Sinkhorn iterations per step")
    left.set_ylabel("top-1 accuracy (%)", color="C0")
    right = left.twinx()
    right.semilogx(xs, [r["prune_seconds"] for r in table], "s--", color="C1")
    right.set_ylabel("DTP stage wall time (s)", color="C1")
    left.set_title(f"digits CNN, {args.ratio:.0%} pruned (cf. paper Fig. 4)")
    fig.tight_layout()
    fig.savefig(out / "fig4_iterations.png", dpi=90)
    print(f"plot: {out / 'fig4_iterations.png'}")


if __name__ == "__main__":
    main()
