"""How the mask step (forward + backward) scales with size, per backend: total elements
from 1e3 to 1e7 and segment counts from 1 to 512, in one interleaved run.

    python benchmarks/bench_scaling.py [--device cpu|cuda] [--rounds N]

Few large segments are the unstructured per-weight case (one segment per layer's
weights); many small ones the filter-group case. For each size it also reports the
memory the step allocates (CUDA: peak allocator growth; CPU: the allocations the
profiler records) and the effective bandwidth against an in-run copy: the step must at
least read scores and log-odds and write mask and new log-odds (forward), then read the
gradient, scores and log-odds and write the score gradient (backward), 32 bytes per
element in float32, while a copy moves 8.

Appends rows to benchmarks/results/scaling.csv; writes scaling_<device>.md and a log-log
plot scaling_<device>.png.
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
from dtp_kernels.benchmarking import mask_step

SIZES = [1_000, 10_000, 100_000, 1_000_000, 10_000_000]
SEGMENTS = [1, 8, 64, 512]
BYTES_PER_ELEMENT = 32  # fp32: fwd reads 2, writes 2; bwd reads 3, writes 1


def segment_sizes(numel: int, nseg: int) -> list[int]:
    base, extra = divmod(numel, nseg)
    return [base + (1 if i < extra else 0) for i in range(nseg)]


def allocated_bytes(step, device: torch.device) -> int:
    """Bytes one step allocates beyond what is already held."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(max(e.cpu_memory_usage, 0) for e in prof.events() if e.cpu_memory_usage > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-numel", type=int, default=SIZES[-1])
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    backends = [b for b in dtp_kernels.available_backends(device) if b != "reference"]
    if device.type == "cpu":
        backends = [b for b in backends if b != "triton"]
    print(env)
    rows, table = [], []
    for numel in [n for n in SIZES if n <= args.max_numel]:
        copy_src = torch.randn(numel, device=device)
        cases = {"copy": (lambda src=copy_src: src.clone(), 20)}
        layouts = [s for s in SEGMENTS if s <= numel]
        for nseg in layouts:
            for backend in backends:
                inner = max(1, min(20, 2_000_000 // numel))
                step = mask_step(backend, segment_sizes(numel, nseg), device, ratio=0.5)
                cases[f"{backend}|{nseg}"] = (step, inner)
        samples = interleaved(cases, args.rounds, device, warmup=2)
        copy_us = summarize(samples["copy"])["median_us"]
        for name, values in samples.items():
            if name == "copy":
                continue
            backend, nseg = name.split("|")
            stats = summarize(values)
            memory = allocated_bytes(cases[name][0], device)
            bandwidth_vs_copy = (copy_us / 8) / (stats["median_us"] / BYTES_PER_ELEMENT)
            rows.append(
                dict(
                    op="transport_mask_scaling",
                    provider=backend,
                    mode="full",
                    shape=f"numel={numel} segments={nseg}",
                    dtype="float32",
                    **stats,
                    **env,
                )
            )
            table.append((numel, int(nseg), backend, stats["median_us"], memory, bandwidth_vs_copy))
            print(
                f"{numel:>9} {nseg:>4} {backend:>7} {stats['median_us']:10.1f} us "
                f"{memory / 2**20:8.2f} MiB  {100 * bandwidth_vs_copy:5.1f}% of copy"
            )
    lines = [
        "# transport_mask forward + backward: scaling",
        "",
        f"device: {env['device']}; threads: {env['threads']}; torch {env['torch']}; "
        f"triton {env['triton']}; date {env['date']}; float32, {args.rounds} rounds",
        "",
        "`% of copy`: effective bandwidth (32 B per element moved by a fwd + bwd) over the "
        "bandwidth of a same-run copy (8 B per element). `MiB`: allocated by one step.",
        "",
        "| elements | segments | backend | median us | MiB allocated | % of copy bandwidth |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for numel, nseg, backend, median, memory, bw in table:
        lines.append(
            f"| {numel:,} | {nseg} | {backend} | {median:.1f} | "
            f"{memory / 2**20:.2f} | {100 * bw:.1f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        append_rows(RESULTS / "scaling.csv", rows)
        (RESULTS / f"scaling_{device.type}.md").write_text(report)
        plot(table, RESULTS / f"scaling_{device.type}.png", env)


def plot(table: list, path: Path, env: dict) -> None:
    """Median time against elements, one panel per segment count, a line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segments = sorted({row[1] for row in table})
    fig, axes = plt.subplots(1, len(segments), figsize=(4 * len(segments), 3.6), sharey=True)
    for ax, nseg in zip(axes, segments, strict=True):
        for backend in dict.fromkeys(row[2] for row in table):
            points = [(r[0], r[3]) for r in table if r[1] == nseg and r[2] == backend]
            ax.loglog(*zip(*points, strict=True), marker="o", label=backend)
        ax.set_title(f"{nseg} segment{'s' if nseg > 1 else ''}")
        ax.set_xlabel("elements")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fwd + bwd median us")
    axes[0].legend()
    fig.suptitle(f"transport_mask scaling, {env['device']}, torch {env['torch']}, {env['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
