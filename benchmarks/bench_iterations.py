"""The cost of more Sinkhorn iterations per step (iters 1, 10, 100: the regime of soft
top-k methods that solve the transport problem to convergence every step) against DTP's
one warm-started step, forward + backward, per backend, interleaved in one run.

    python benchmarks/bench_iterations.py [--device cpu|cuda] [--rounds N]

Layouts: ResNet-50's 32 filter groups (7,552 channels) and one unstructured segment of
1,048,576 weights. The fused Triton kernels do one iteration; with more, Triton runs the
eager closed form (the documented fallback), so its rows show that path.

Appends rows to benchmarks/results/iterations.csv; writes iterations_<device>.md.
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

ITERS = [1, 10, 100]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    backends = [b for b in dtp_kernels.available_backends(device) if b != "reference"]
    if device.type == "cpu":
        backends = [b for b in backends if b != "triton"]
    layouts = {"resnet50 32 groups": RESNET50_GROUPS, "1 segment of 2^20": [1 << 20]}
    print(env)
    rows, lines = [], []
    for label, sizes in layouts.items():
        cases = {}
        for backend in backends:
            if backend in ("torch", "triton") and device.type == "cuda" and len(sizes) == 1:
                continue  # eager segment sums of one 2^20 segment (Triton's iters > 1 too)
            for iters in ITERS:
                inner = max(1, 20 // iters) if sum(sizes) < 100_000 else 1
                cases[(backend, iters)] = (mask_step(backend, sizes, device, iters=iters), inner)
        samples = interleaved(cases, args.rounds, device, warmup=1)
        lines += [
            f"## {label}",
            "",
            "| backend | iters | median us | x vs iters=1 |",
            "| --- | ---: | ---: | ---: |",
        ]
        for (backend, iters), values in samples.items():
            stats = summarize(values)
            one = summarize(samples[(backend, 1)])["median_us"]
            rows.append(
                dict(
                    op="transport_mask_iters",
                    provider=backend,
                    mode=f"iters={iters}",
                    shape=label,
                    dtype="float32",
                    **stats,
                    **env,
                )
            )
            lines.append(
                f"| {backend} | {iters} | {stats['median_us']:.1f} | "
                f"{stats['median_us'] / one:.1f} |"
            )
        lines.append("")
    header = [
        "# transport_mask fwd + bwd against the number of Sinkhorn iterations",
        "",
        f"device: {env['device']}; threads: {env['threads']}; torch {env['torch']}; "
        f"triton {env['triton']}; date {env['date']}; float32, {args.rounds} rounds",
        "",
    ]
    report = "\n".join(header + lines)
    print(report)
    if not args.no_save:
        append_rows(RESULTS / "iterations.csv", rows)
        (RESULTS / f"iterations_{device.type}.md").write_text(report)


if __name__ == "__main__":
    main()
