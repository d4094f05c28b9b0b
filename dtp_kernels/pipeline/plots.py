"""The pipeline's PNG plots: soft-mask evolution of sample filters (paper Fig. 3a),
learned per-layer kept ratios (Fig. 7) and accuracy against the pruning ratio."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mask_evolution(trace: dict[str, list[list[float]]], path: Path, title: str = "") -> None:
    """trace: group name -> one list per recorded epoch of the sample filters' soft masks
    (epoch 0 is before training)."""
    plt = _pyplot()
    names = list(trace)
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        series = list(zip(*trace[name], strict=True))  # per filter, over epochs
        for index, values in enumerate(series):
            ax.plot(range(len(values)), values, marker=".", label=f"filter {index}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("epoch")
        ax.set_ylabel("soft mask")
        ax.set_ylim(bottom=-0.05)  # early soft masks can exceed 1
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title or "soft-mask evolution of sample filters (cf. paper Fig. 3a)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def learned_sparsity(groups: list[dict], path: Path, title: str = "") -> None:
    """groups: pruner.report()["groups"] rows (name, n, k): kept fraction per layer."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(groups)), 3.5))
    ax.bar(range(len(groups)), [g["k"] / g["n"] for g in groups])
    ax.set_xticks(range(len(groups)), [g["name"] for g in groups], rotation=90, fontsize=7)
    ax.set_ylabel("kept fraction")
    ax.set_ylim(0, 1)
    ax.set_title(title or "learned per-layer kept fraction (cf. paper Fig. 7)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def accuracy_vs_ratio(rows: list[dict], path: Path, title: str = "") -> None:
    """rows: {"method", "ratio", "accuracy"}; one line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r["ratio"], 100 * r["accuracy"]) for r in rows if r["method"] == method)
        ax.plot(*zip(*points, strict=True), marker="o", label=method)
    ax.set_xlabel("pruning ratio (fraction of filters removed)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(title or "accuracy against pruning ratio")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
