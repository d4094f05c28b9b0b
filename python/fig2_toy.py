"""Paper Fig. 2: DTP on the toy problem w = (2, 1, 3), keep 1, loss w . mask. Plots the
soft mask, the scores and the loss over the steps (default 1000)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.demo import fig2_toy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--eps", type=float, default=1.0)
    parser.add_argument("--out", default="runs/fig2_toy")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = fig2_toy(args.steps, args.lr, args.eps)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r[0] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for index, weight in enumerate((2, 1, 3)):
        axes[0].plot(steps, [r[1][index] for r in rows], label=f"m{index + 1} (w = {weight})")
        axes[1].plot(steps, [r[3][index] for r in rows], label=f"s{index + 1} (w = {weight})")
    axes[2].plot(steps, [r[2] for r in rows])
    for ax, title in zip(axes, ("soft mask", "scores", "loss w . mask"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    axes[1].legend()
    fig.suptitle(f"DTP toy (paper Fig. 2): keep 1 of w = (2, 1, 3), eps {args.eps}, lr {args.lr}")
    fig.tight_layout()
    fig.savefig(out / "fig2_toy.png", dpi=90)
    final = rows[-1]
    print(f"step {final[0]}: mask {[round(v, 4) for v in final[1]]}, loss {final[2]:.4f}")
    print(f"plot: {out / 'fig2_toy.png'}")


if __name__ == "__main__":
    main()
