"""The pruner's own host work per training step on torchvision's ResNet-50: the forward
pre-hook (mask step forward, BN fold) and the commit after the optimizer step, with the
fold as one C++ autograd node (what DTPPruner runs when dtp_kernels._C is built) and as
the Python ops, in one run. Medians of single calls on one thread, CPU tensors.

    python benchmarks/bench_pruner_host.py [--calls N] [--no-save]

Writes results/pruner_host_cpu.md.
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

from _harness import RESULTS, environment

from dtp_kernels import _C
from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.masking import folded_products


def median_us(call, calls: int) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if _C is None:
        raise SystemExit("bench_pruner_host.py needs dtp_kernels._C (make build)")
    import torchvision

    torch.set_num_threads(1)
    model = torchvision.models.resnet50()
    pruner = DTPPruner(model, torch.randn(1, 3, 64, 64), 0.5)
    model.train()
    originals = [original for _, original in pruner._fold]
    pruner._compute_masks(model, ())
    flat, plan = pruner._source.flat, pruner._fold_plan

    def pre_hook() -> None:
        pruner._compute_masks(model, ())
        pruner._source.release_graph()

    rows = {
        "forward pre-hook (mask step + fold)": median_us(pre_hook, args.calls),
        "mask step forward": median_us(lambda: pruner._transport(update=True), args.calls),
        "fold, C++ node": median_us(
            lambda: _C.fold_products(originals, flat, plan.channels), args.calls
        ),
        "fold, Python ops": median_us(lambda: folded_products(flat, plan, originals), args.calls),
        "commit (after the optimizer step)": median_us(pruner.state.commit, args.calls),
    }
    env = environment(torch.device("cpu"))
    lines = [
        "# The pruner's host work per step (`benchmarks/bench_pruner_host.py`)",
        "",
        f"{env['device']}, 1 thread; torch {env['torch']}; {env['date']}; torchvision "
        f"ResNet-50, {len(pruner.groups)} groups, {len(originals)} folded BN parameters; "
        f"median of {args.calls} calls.",
        "",
        "| part | us |",
        "| --- | ---: |",
        *(f"| {name} | {us:.1f} |" for name, us in rows.items()),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        (RESULTS / "pruner_host_cpu.md").write_text(report)


if __name__ == "__main__":
    main()
