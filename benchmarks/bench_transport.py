"""Forward and forward + backward of the DTP mask step for all 32 prunable groups of
torchvision's ResNet-50 (conv1 and conv2 of every bottleneck, ratio 0.6), per backend,
measured interleaved in one run; ratios against "reference" and "torch".

    python benchmarks/bench_transport.py [--device cpu|cuda] [--rounds 30]

On CUDA the providers are reference, torch (eager), triton and torch.compile of the eager
closed form; on CPU reference, torch and cpu (C++).

Appends rows to benchmarks/results/transport.csv and writes a summary to
benchmarks/results/transport_<device>.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, append_rows, environment, interleaved, summarize

import dtp_kernels
from dtp_kernels.benchmarking import RESNET50_GROUPS, mask_step

RATIO = 0.6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = RESNET50_GROUPS
    backends = dtp_kernels.available_backends(device)
    if device.type == "cuda":  # the eager closed form compiled: the baseline to beat on GPU
        backends.append("torch.compile")
    env = environment(device)
    shape = f"resnet50 {len(sizes)} groups, {sum(sizes)} channels"
    print(f"{shape}; {env}")

    rows, medians = [], {}
    for mode, backward in (("fwd", False), ("full", True)):
        cases = {}
        for backend in backends:
            inner = 2 if backend == "reference" else 50
            compiled = backend == "torch.compile"  # the eager closed form, compiled
            step = mask_step("torch" if compiled else backend, sizes, device, RATIO,
                             backward=backward, compiled=compiled)  # fmt: skip
            cases[backend] = (step, inner)
        samples = interleaved(cases, args.rounds, device)
        for backend in backends:
            stats = summarize(samples[backend])
            medians[(mode, backend)] = stats["median_us"]
            rows.append(
                dict(op="transport_mask", provider=backend, mode=mode, shape=shape,
                     dtype="float32", **stats, **env)
            )  # fmt: skip

    lines = [
        f"# transport_mask, {shape}",
        "",
        f"device: {env['device']}; threads: {env['threads']}; torch {env['torch']}; "
        f"triton {env['triton']}; date {env['date']}",
        "",
        "| mode | backend | median us | p20 us | p80 us | x vs reference | x vs torch |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        ref = medians[(row["mode"], "reference")]
        eager = medians[(row["mode"], "torch")]
        lines.append(
            f"| {row['mode']} | {row['provider']} | {row['median_us']:.1f} | {row['p20_us']:.1f} "
            f"| {row['p80_us']:.1f} | {ref / row['median_us']:.1f} "
            f"| {eager / row['median_us']:.2f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        append_rows(RESULTS / "transport.csv", rows)
        (RESULTS / f"transport_{device.type}.md").write_text(report)
        plot(rows, RESULTS / f"transport_{device.type}.png", shape, env)


def plot(rows: list[dict], path: Path, shape: str, env: dict) -> None:
    """Median time per backend, fwd and fwd + bwd, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.4
    for i, mode in enumerate(("fwd", "full")):
        medians = {r["provider"]: r["median_us"] for r in rows if r["mode"] == mode}
        xs = [p + i * width for p in range(len(providers))]
        label = "fwd" if mode == "fwd" else "fwd + bwd"
        ax.bar(xs, [medians[p] for p in providers], width, label=label)
    ax.set_xticks([p + width / 2 for p in range(len(providers))], providers)
    ax.set_yscale("log")
    ax.set_ylabel("median us (log)")
    ax.set_title(f"transport_mask, {shape}\n{env['device']}, torch {env['torch']}, {env['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
