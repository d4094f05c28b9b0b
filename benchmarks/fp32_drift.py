"""How far fp32 drifts from the float64 reference over the 200-step training loop of the
tests (tests/utils.run_loop's layout and loss), per backend: the largest absolute error
of the mask, the score gradient and the keep gradient over all steps. The README quotes
these; the tests allow 3e-4 absolute plus 1e-3 relative.

    python benchmarks/fp32_drift.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import environment

from dtp_kernels import available_backends
from utils import run_loop


def drift(backend: str, iters: int) -> list[float]:
    worst = [0.0, 0.0, 0.0]
    run_loop(backend, torch.float32, iters, steps=200, worst=worst)
    return worst


def main() -> None:
    env = environment(torch.device("cpu"))
    print(
        f"{env['device']}, torch {env['torch']}, {env['date']}: fp32 against the float64 "
        "reference over the 200-step loop, largest absolute error"
    )
    print("| backend | iters | mask | score grad | keep grad |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for backend in [b for b in available_backends("cpu") if b in ("torch", "cpu")]:
        for iters in (1, 5):
            errors = drift(backend, iters)
            print(f"| {backend} | {iters} | " + " | ".join(f"{e:.2e}" for e in errors) + " |")


if __name__ == "__main__":
    main()
