"""Where a DTP training step's extra time goes on a GPU: host issue time against device
time, dense against DTP-masked, for the bench_training_step GPU workload.

    python benchmarks/profile_training_step.py [--strategy fold] [--backend cuda]
        [--compile] [--workload resnet56]

For each case it reports, per step: the wall time (synchronised), the time the host
spends issuing the step, the summed device time of its kernels and their count, and the
kernels the masked step adds. A step whose host time is close to its wall time is
host-bound: there its overhead is the host cost of the extra operators, not their
kernels. --compile runs both models under torch.compile (default mode); --workload
resnet56 profiles bench_pipeline.py's CIFAR ResNet-56 step (batch 256, fp32) instead of
ResNet-50. Writes benchmarks/results/training_step_profile_<device>[_<workload>][_compiled].md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, environment, sync
from bench_training_step import make_case, workloads

from dtp_kernels.models import get_model


def kernel_times(step, steps: int, device: torch.device, host: bool = False):
    """Per step and name: device microseconds and launches of each kernel, or with
    host=True (and on CPU) the host's self microseconds and calls of each operator."""
    cuda = device.type == "cuda" and not host
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    times, counts = Counter(), Counter()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for event in prof.events():
        if event.device_type == kind:
            times[event.name] += (event.device_time if cuda else event.self_cpu_time_total) / steps
            counts[event.name] += 1 / steps
    return times, counts


def added(profiles: dict, title: str, unit: str) -> list[str]:
    """Rows of the names the masked step adds most to, from {case: (times, counts)}."""
    (dense_t, dense_c), (dtp_t, dtp_c) = profiles.values()
    extra = Counter({k: dtp_t[k] - dense_t.get(k, 0.0) for k in dtp_t})
    lines = ["", title, "", f"| name | extra {unit} | extra calls |", "| --- | ---: | ---: |"]
    for name, us in extra.most_common(15):
        calls = dtp_c[name] - dense_c.get(name, 0)
        if us > 0.05 or calls > 0:
            lines.append(f"| {name[:90]} | {us:.1f} | {calls:.0f} |")
    return lines


def wall_and_host(step, device: torch.device) -> tuple[float, float]:
    """One step: ms until synchronised, ms until the host has issued it."""
    sync(device)
    start = time.perf_counter()
    step()
    host = time.perf_counter() - start
    sync(device)
    return (time.perf_counter() - start) * 1e3, host * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fold")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on the CPU workload")
    parser.add_argument(
        "--python", action="store_true", help="also print cProfile top functions of both"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument(
        "--workload",
        choices=["default", "resnet56"],
        default="default",
        help="resnet56: bench_pipeline.py's CIFAR ResNet-56 step (batch 256, fp32)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    work = workloads(device)[-1]  # CPU: the small digits CNN
    if args.workload == "resnet56":  # bench_pipeline.py's CIFAR workload
        work = dict(model="resnet56", batch=256, size=32, classes=10, amp=None, channels_last=False)
    torch.manual_seed(0)
    base = get_model(work["model"], num_classes=work["classes"])
    masked = f"{args.strategy}/{args.backend}"
    names = {"dense": (None, None), masked: (args.strategy, args.backend)}
    steps = {
        name: make_case(work, base, device, *spec, compile_model=args.compile)
        for name, spec in names.items()
    }
    for step in steps.values():
        for _ in range(3):
            step()
    lines = [
        "# Where the DTP step's time goes (GPU)",
        "",
        f"device: {env['device']}; torch {env['torch']}; triton {env['triton']}; "
        f"date {env['date']}; {work['model']} batch {work['batch']}"
        f"{' bf16 channels_last' if work['amp'] else ''}"
        f"{'; torch.compile (default mode)' if args.compile else ''}; "
        f"medians of {args.rounds} alternating steps",
        "",
        "| case | wall ms | host issue ms | device busy ms | kernels |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    samples = {name: ([], []) for name in steps}
    for _ in range(args.rounds):  # alternate the cases: same clocks and host load
        for name, step in steps.items():
            wall, host = wall_and_host(step, device)
            samples[name][0].append(wall)
            samples[name][1].append(host)
    profiles = {name: kernel_times(step, 5, device) for name, step in steps.items()}
    for name in steps:
        times, counts = profiles[name]
        lines.append(
            f"| {name} | {statistics.median(samples[name][0]):.2f} | "
            f"{statistics.median(samples[name][1]):.2f} | {sum(times.values()) / 1e3:.2f} | "
            f"{sum(counts.values()):.0f} |"
        )
    lines += added(profiles, "Kernels the masked step adds (device us per step, launches):", "us")
    if device.type == "cuda":  # where the host's extra time goes
        host = {name: kernel_times(step, 5, device, host=True) for name, step in steps.items()}
        lines += added(
            host,
            "Operators the masked step adds on the host (self us per step, "
            "profiler overhead included):",
            "host us",
        )
    if args.python:
        import cProfile
        import pstats

        for name, step in steps.items():
            print(f"cProfile, 10 steps of {name}:")
            profiler = cProfile.Profile()
            profiler.runcall(lambda step=step: [step() for _ in range(10)])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    report = "\n".join([*lines, ""])
    print(report)
    if device.type == "cuda":
        suffix = "" if args.workload == "default" else f"_{args.workload}"
        suffix += "_compiled" if args.compile else ""
        (RESULTS / f"training_step_profile_{device.type}{suffix}.md").write_text(report)


if __name__ == "__main__":
    main()
