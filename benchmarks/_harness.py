"""Shared benchmark plumbing: interleaved timing, machine description, CSV rows."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import dtp_kernels

RESULTS = Path(__file__).parent / "results"
CSV_FIELDS = [
    "op", "provider", "mode", "shape", "dtype", "median_us", "p20_us", "p80_us",
    "device", "threads", "torch", "triton", "date",
]  # fmt: skip


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    cases: dict[str, tuple[Callable[[], None], int]],
    rounds: int,
    device: torch.device,
    warmup: int = 3,
) -> dict[str, list[float]]:
    """Time every case in turn, round after round, so all see the same machine state.

    cases maps a name to (function, calls per sample). Returns seconds per call samples.
    """
    for fn, inner in cases.values():
        for _ in range(warmup * inner):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, inner) in cases.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def summarize(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=10)
    return {
        "median_us": statistics.median(samples) * 1e6,
        "p20_us": q[1] * 1e6,
        "p80_us": q[7] * 1e6,
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
