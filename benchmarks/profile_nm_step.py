"""Where the N:M mask step's time goes: each kernel's share of one fwd + bwd step over
`numel` weights (2:4 blocks, and the same weights as one segment), against a copy of the
bytes the step must move, the baseline of bench_nm_step.py.

    python benchmarks/profile_nm_step.py [--device cpu|cuda] [--numel N ...] [--steps S]

For each case it reports the wall time of a synchronised step, the device time its
kernels sum to (on the CPU: the operators' own time) and the copy's time over that sum:
the fraction of copy bandwidth the kernels reach, as bench_nm_step.py's "x vs copy" is
for the wall time. Then every kernel (or
operator) of the step with its time and launches per step, so a step that falls short
shows which kernel does, and whether the gap is in the kernels or between them (wall
time well above device time: launches and host work). Writes
benchmarks/results/nm_step_profile_<device>.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, environment, sync
from bench_nm_step import STEP_FLOATS, copy_of_step_bytes, step
from profile_training_step import kernel_times

import dtp_kernels

COPY = "copy of the step's bytes"


def cases(numel: int, device: torch.device) -> dict:
    """The steps profiled: bench_nm_step.py's, on the device's compiled backend, and on a
    GPU also on the Triton kernels."""
    backend = dtp_kernels.available_backends(device)[-1]
    blocks = [4] * (numel // 4)
    out = {
        COPY: copy_of_step_bytes(numel, device),
        f"2:4, {backend}": step(blocks, 0.5, device, backend),
        f"one segment, {backend}": step([numel], 0.5, device, backend),
    }
    if backend == "cuda" and "triton" in dtp_kernels.available_backends(device):
        out["2:4, triton"] = step(blocks, 0.5, device, "triton")
        out["one segment, triton"] = step([numel], 0.5, device, "triton")
    return out


def wall_ms(run, device: torch.device, steps: int) -> float:
    """The median wall time of `steps` synchronised steps."""
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def report(numel: int, device: torch.device, steps: int) -> list[str]:
    """The markdown section of one size: the summary table, then each case's kernels."""
    runs = cases(numel, device)
    for run in runs.values():  # warm-up: compiled kernels, allocator, huge pages
        run()
        run()
    walls = {name: wall_ms(run, device, steps) for name, run in runs.items()}
    profiles = {name: kernel_times(run, steps, device) for name, run in runs.items()}
    busy = {name: sum(times.values()) / 1e3 for name, (times, _) in profiles.items()}
    unit = "device" if device.type == "cuda" else "operator"
    lines = [
        f"## {numel} weights ({STEP_FLOATS * 4} bytes per weight moved)",
        "",
        f"| case | wall ms | {unit} ms | x vs copy, {unit} time |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in runs:
        lines.append(
            f"| {name} | {walls[name]:.3f} | {busy[name]:.3f} | {busy[COPY] / busy[name]:.2f} |"
        )
    for name, (times, counts) in profiles.items():
        if name == COPY:
            continue
        lines += ["", f"{name}: per step", "", f"| {unit} | us | share | calls |"]
        lines.append("| --- | ---: | ---: | ---: |")
        total = sum(times.values()) or 1.0
        for kernel, us in times.most_common(8):
            lines.append(f"| {kernel[:90]} | {us:.1f} | {us / total:.0%} | {counts[kernel]:.0f} |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--numel", type=int, nargs="+", help="default: 1e7 (and 1e8 on a GPU)")
    parser.add_argument("--steps", type=int, default=5, help="steps timed and profiled per case")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = args.numel or ([10**7, 10**8] if device.type == "cuda" else [10**7])
    bad = [n for n in sizes if n < 4 or n % 4]
    if bad:
        parser.error(f"--numel must be positive multiples of 4 (2:4 blocks), got {bad}")
    env = environment(device)
    lines = [
        "# Where the N:M mask step's time goes",
        "",
        f"device: {env['device']}; threads: {env['threads']}; torch {env['torch']}; "
        f"triton {env['triton']}; date {env['date']}; medians and means of {args.steps} steps",
        "",
    ]
    for numel in sizes:
        lines += report(numel, device, args.steps)
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        (RESULTS / f"nm_step_profile_{device.type}.md").write_text(text)


if __name__ == "__main__":
    main()
