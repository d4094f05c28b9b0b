"""Shared benchmark plumbing: machine description and CSV rows; the interleaved timing
is dtp_kernels.benchmarking (also behind `dtp bench`)."""

from __future__ import annotations

import csv
import datetime
import os
import platform
from pathlib import Path

import torch

import dtp_kernels
from dtp_kernels.benchmarking import interleaved, summarize, sync  # noqa: F401 - re-exported

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


def append_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in CSV_FIELDS})
