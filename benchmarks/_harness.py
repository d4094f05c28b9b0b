"""The benchmark harness: a benchmark is a setup function and a sweep; the harness times
every provider of a sweep point interleaved (dtp_kernels.benchmarking, also behind `dtp
bench`), records the device and versions, appends rows of one CSV schema, writes the
markdown table and the plot (plot_results.py)."""

from __future__ import annotations

import csv
import datetime
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import dtp_kernels
from dtp_kernels.benchmarking import (  # noqa: F401 - re-exported for the scripts
    RESNET50_GROUPS,
    interleaved,
    paired_overhead,
    summarize,
    sync,
)

RESULTS = Path(__file__).parent / "results"
# the mask step's usual sweep point: all 32 prunable groups of ResNet-50
RESNET50_POINT = dict(
    shape=f"resnet50 {len(RESNET50_GROUPS)} groups, {sum(RESNET50_GROUPS)} channels",
    dtype="float32",
    sizes=RESNET50_GROUPS,
)
CSV_FIELDS = [
    "op",
    "provider",
    "mode",
    "shape",
    "dtype",
    "median_us",
    "p20_us",
    "p80_us",
    "device",
    "threads",
    "torch",
    "triton",
    "date",
]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({os.cpu_count()} cores)"


def environment(device: torch.device) -> dict:
    info = dtp_kernels.build_info()
    return {
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "torch": info["torch"],
        "triton": info["triton"],
        "date": datetime.date.today().isoformat(),
    }


def append_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in CSV_FIELDS})


# (provider, mode) -> (callable, calls per sample)
Cases = dict[tuple[str, str], tuple[Callable[[], object], int]]


@dataclass
class Sweep:
    """A benchmark: `setup(point, device)` builds the cases of one sweep point, a dict
    with "shape" and "dtype" (and whatever else setup reads; "devices", a tuple of device
    types, runs the point on those alone); `baselines` are the
    providers each row's ratio is taken against (their time over this row's, from the
    same point and mode, or from the baseline's only mode)."""

    op: str
    title: str
    points: list[dict]
    setup: Callable[[dict, torch.device], Cases]
    baselines: list[str] = field(default_factory=list)
    warmup: int = 3
    note: str = ""


def main(sweep: Sweep, name: str, description: str, rounds: int = 30) -> list[dict]:
    """The command line every sweep script shares: --device, --rounds, --no-save."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="have glibc's malloc keep freed memory for reuse (results/<name>_keep_memory_*)",
    )
    parser.add_argument(
        "--no-output-cache",
        action="store_true",
        help="the CPU kernels' outputs in fresh memory, none reused "
        "(dtp_kernels.set_cpu_output_cache(0); results/<name>_no_output_cache_*)",
    )
    args = parser.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
        name += "_keep_memory"
    if args.no_output_cache:
        import dtp_kernels

        dtp_kernels.set_cpu_output_cache(0)
        ALLOCATOR_NOTES.append("no output cache (set_cpu_output_cache(0))")
        name += "_no_output_cache"
    return run_sweep(sweep, torch.device(args.device), args.rounds, not args.no_save, name)


def keep_freed_memory() -> None:
    """Make glibc's malloc serve every allocation from its heap and keep freed memory for
    reuse, as jemalloc and tcmalloc do. By default each CPU tensor over 32 MiB is a fresh
    mmap, so every step pays page faults on all of it (here several milliseconds per
    tensor) that a copy into a reused buffer does not."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise RuntimeError("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD")
    ALLOCATOR_NOTES.append("malloc keeps freed memory (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD)")


# What the run changed about the process, printed with the environment.
ALLOCATOR_NOTES: list[str] = []


def run_sweep(sweep: Sweep, device: torch.device, rounds: int, save: bool, name: str) -> list[dict]:
    """Time every point of `sweep`; print the table; with `save`, append the rows to
    results/<name>.csv and write results/<name>_<device>.md and .png."""
    env = environment(device)
    rows = []
    for point in sweep.points:
        if device.type not in point.get("devices", (device.type,)):
            continue  # a point for other devices (e.g. too large for this one)
        samples = interleaved(sweep.setup(point, device), rounds, device, sweep.warmup)
        for (provider, mode), times in samples.items():
            rows.append(
                dict(
                    op=sweep.op,
                    provider=provider,
                    mode=mode,
                    shape=point["shape"],
                    dtype=point["dtype"],
                    **summarize(times),
                    **env,
                )
            )
    report = markdown(sweep, rows, env)
    print(report)
    if save:
        append_rows(RESULTS / f"{name}.csv", rows)
        (RESULTS / f"{name}_{device.type}.md").write_text(report)
        from plot_results import plot_rows

        plot_rows(
            rows,
            RESULTS / f"{name}_{device.type}.png",
            f"{sweep.title}\n{env['device']}, torch {env['torch']}, {env['date']}",
        )
    return rows


def markdown(sweep: Sweep, rows: list[dict], env: dict) -> str:
    """The rows as a table: medians with p20 and p80, and the ratio to each baseline."""
    by_key = {(r["shape"], r["dtype"], r["provider"], r["mode"]): r["median_us"] for r in rows}
    modes = {}
    for r in rows:
        modes.setdefault((r["shape"], r["dtype"], r["provider"]), []).append(r["mode"])
    head = "| shape | dtype | mode | provider | median us | p20 us | p80 us |"
    head += "".join(f" x vs {b} |" for b in sweep.baselines)
    lines = [
        f"# {sweep.title}",
        "",
        f"device: {env['device']}; threads: {env['threads']}; torch {env['torch']}; "
        f"triton {env['triton']}; date {env['date']}"
        + "".join(f"; {note}" for note in ALLOCATOR_NOTES),
        "",
        head,
        "| --- | --- | --- | --- |" + " ---: |" * (3 + len(sweep.baselines)),
    ]
    for r in rows:
        ratios = []
        for base in sweep.baselines:
            own = modes.get((r["shape"], r["dtype"], base), [])
            mode = r["mode"] if r["mode"] in own else (own[0] if len(own) == 1 else None)
            time = by_key.get((r["shape"], r["dtype"], base, mode))
            ratios.append(f" {time / r['median_us']:.2f} |" if time else " - |")
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['provider']} | "
            f"{r['median_us']:.1f} | {r['p20_us']:.1f} | {r['p80_us']:.1f} |" + "".join(ratios)
        )
    note = f"\n`x vs P`: P's median over this row's (> 1: faster than P). {sweep.note}\n"
    return "\n".join(lines) + "\n" + note


def training_step_cases(
    base: torch.nn.Module,
    loss: Callable[[torch.nn.Module], torch.Tensor],
    example_inputs: tuple,
    ratios: dict,
    amp: torch.dtype | None,
) -> dict:
    """A training-step benchmark's cases: SGD steps of a copy of `base` (forward under
    autocast to `amp` when set, `loss(model)`, backward, optimizer step) without masks
    ("dense") and with DTP's masks at `ratios` made by `prepare` ("dtp")."""
    import copy

    from dtp_kernels import prepare

    device_type = next(base.parameters()).device.type

    def case(pruned: bool) -> Callable[[], None]:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if pruned:
            prepare(model, optimizer, example_inputs, ratios)
        model.train()

        def step() -> None:
            with torch.autocast(device_type, amp, enabled=amp is not None):
                value = loss(model)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()  # DTP's commit runs as the optimizer's step hook

        return step

    return {("dense", "train"): (case(False), 1), ("dtp", "train"): (case(True), 1)}


def step_overhead_main(
    doc: str, sweep: Callable[[torch.device], Sweep], name: str, rounds: int
) -> None:
    """The command line of a training-step benchmark (`--device`, `--rounds`, `--save`):
    time `sweep`'s dense and dtp steps interleaved, then print DTP's overhead per point,
    median(dtp) / median(dense) - 1, appended with `--save` to results/<name>_<device>.md."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = run_sweep(sweep(device), device, args.rounds, args.save, name)
    lines = ["", f"DTP overhead (medians of {args.rounds} interleaved rounds):"]
    for shape in dict.fromkeys(row["shape"] for row in rows):
        median = {row["provider"]: row["median_us"] for row in rows if row["shape"] == shape}
        lines.append(f"- {shape}: {median['dtp'] / median['dense'] - 1:+.2%}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.save:
        with (RESULTS / f"{name}_{device.type}.md").open("a") as report:
            report.write(text)
