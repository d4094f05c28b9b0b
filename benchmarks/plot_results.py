"""The one plotting script: median time per provider and mode, one panel per shape and
dtype, log scale, from rows of the harness's CSV schema.

    python benchmarks/plot_results.py results/transport.csv --device "NVIDIA H200" --date 2026-11-26

The benchmark scripts call plot_rows() on the rows of their run.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def plot_rows(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, len(points), figsize=(5 * len(points), 4), squeeze=False)
    width = 0.8 / len(providers)
    for ax, (shape, dtype) in zip(axes[0], points, strict=True):
        medians = {
            (r["provider"], r["mode"]): float(r["median_us"])
            for r in rows
            if (r["shape"], r["dtype"]) == (shape, dtype)
        }
        for i, provider in enumerate(providers):
            xs = [m + i * width for m in range(len(modes))]
            ax.bar(xs, [medians.get((provider, mode), 0) for mode in modes], width, label=provider)
        ax.set_xticks([m + width * (len(providers) - 1) / 2 for m in range(len(modes))], modes)
        ax.set_yscale("log")
        ax.set_ylabel("median us (log)")
        ax.set_title(f"{shape}, {dtype}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--device", help="only rows of this device (default: the last row's)")
    parser.add_argument("--date", help="only rows of this date (default: the last row's)")
    parser.add_argument("--out", type=Path, help="PNG path (default: next to the CSV)")
    args = parser.parse_args()
    with args.csv.open() as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{args.csv} has no rows")
    device, date = args.device or rows[-1]["device"], args.date or rows[-1]["date"]
    rows = [r for r in rows if r["device"] == device and r["date"] == date]
    out = args.out or args.csv.with_suffix(".png")
    plot_rows(rows, out, f"{rows[0]['op']}: {device}, torch {rows[0]['torch']}, {date}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
