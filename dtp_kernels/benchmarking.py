"""Interleaved timing, shared by `dtp bench` and the scripts in benchmarks/.

Every case runs in turn, round after round, so all of them see the same machine state;
speed-ups are ratios of medians measured in the same run.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

# Output channels of conv1 and conv2 of every bottleneck of torchvision's ResNet-50: the
# 32 groups DTP prunes there (7,552 channels).
RESNET50_GROUPS = [64, 64] * 3 + [128, 128] * 4 + [256, 256] * 6 + [512, 512] * 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    cases: dict[str, tuple[Callable[[], None], int]],
    rounds: int,
    device: torch.device,
    warmup: int = 3,
) -> dict[str, list[float]]:
    """Time every case in turn, round after round, the order reversed every other round
    (a case that always ran first or last would carry the effect of its place in the
    round: caches, allocator, clocks). cases maps a name to (function, calls per sample).
    Returns the seconds per call of every sample."""
    for fn, inner in cases.values():
        for _ in range(warmup * inner):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases.items())
    for round_ in range(rounds):
        for name, (fn, inner) in order if round_ % 2 == 0 else order[::-1]:
            sync(device)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, 20th and 80th percentile in microseconds."""
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else [samples[0]] * 9
    return {
        "median_us": statistics.median(samples) * 1e6,
        "p20_us": q[1] * 1e6,
        "p80_us": q[7] * 1e6,
    }


def paired_overhead(
    case: list[float], base: list[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """The overhead of `case` over `base` in percent from samples taken in the same rounds
    (interleaved): the median of the per-round ratios, and a 95% bootstrap interval of
    that median. Pairing by round removes the machine's drift between rounds."""
    import random

    ratios = [c / b - 1 for c, b in zip(case, base, strict=True)]
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    return 100 * statistics.median(ratios), 100 * low, 100 * high


def mask_step(
    backend: str,
    sizes: list[int],
    device: torch.device,
    ratio: float = 0.6,
    iters: int = 1,
    backward: bool = True,
    compiled: bool = False,
):
    """One DTP mask step over segments of `sizes` (keeping n - ceil(ratio n) of each) as
    a callable: the forward and, with `backward`, the backward of the mask against a fixed
    random gradient (``mask.backward(g)``, no loss op of its own). `compiled` runs the
    forward through torch.compile."""
    from . import TransportState, transport_mask

    state = TransportState(sizes, device=device)
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(sum(sizes), generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(sum(sizes), generator=gen).to(device)
    kept = [n - math.ceil(ratio * n) for n in sizes]  # a ratio p prunes ceil(n p) channels
    keep = torch.tensor(kept, dtype=torch.float32, device=device)

    def forward(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return transport_mask(scores, keep, state, iters=iters, backend=backend)

    run = torch.compile(forward) if compiled else forward

    def step() -> None:
        mask = run(scores, keep)
        if backward:
            mask.backward(grad)
            scores.grad = None

    return step


def bench_mask_step(device: str | torch.device = "cpu", rounds: int = 20) -> list[dict]:
    """`dtp bench`: the mask step fwd + bwd on ResNet-50's groups, every backend present,
    interleaved; rows with the median and the ratios to the reference and to eager torch."""
    from . import available_backends

    device = torch.device(device)
    backends = available_backends(device)
    if device.type == "cpu":
        backends = [b for b in backends if b != "triton"]  # interpreted: not a CPU path
    cases = {
        b: (mask_step(b, RESNET50_GROUPS, device), 2 if b == "reference" else 20) for b in backends
    }
    medians = {b: summarize(s)["median_us"] for b, s in interleaved(cases, rounds, device).items()}
    return [
        {
            "backend": b,
            "median_us": m,
            "x_vs_reference": medians["reference"] / m,
            "x_vs_torch": medians["torch"] / m,
        }
        for b, m in medians.items()
    ]
