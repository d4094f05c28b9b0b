"""How much host work one training step has, dense against DTP-masked: what an eager,
host-bound GPU step pays for (benchmarks/README.md).

    python benchmarks/count_step_ops.py [--model torchvision.resnet50] [--time]

Counts every ATen (and dtp) operator call of one SGD training step through a
TorchDispatchMode, and the tensors those allocate, on CPU tensors with the
optimizer's foreach path (the default on CUDA), so the counts are a GPU step's. Views
(slices, splits) allocate nothing and launch no kernel; allocations and kernel-launching
operators are what costs. --time adds the median step time of each case, interleaved
(with a small model and input, `--model resnet56 --size 8`, the difference to dense is
mostly the masked step's host cost).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, environment

from dtp_kernels import DTPPruner
from dtp_kernels.benchmarking import interleaved, summarize
from dtp_kernels.models import get_model
from dtp_kernels.pipeline.step import training_step
from dtp_kernels.pipeline.train import make_optimizer


class CountOps(TorchDispatchMode):
    """Operator calls, and the tensors they allocate: outputs whose storage none of the
    inputs has (on a GPU, each is a request to the caching allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        self.allocations += sum(
            1 for t in _tensors(out) if t.untyped_storage().data_ptr() not in inputs
        )
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="torchvision.resnet50")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--time", action="store_true", help="also time the steps")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--label", default="", help="what code was measured, for --save")
    parser.add_argument(
        "--save", action="store_true", help="append the lines to benchmarks/results/step_ops_cpu.md"
    )
    args = parser.parse_args()
    lines: list[str] = []
    torch.manual_seed(0)
    classes = 1000 if args.model.startswith("torchvision.") else 10
    base = get_model(args.model, classes)
    images = torch.randn(2, 3, args.size, args.size)
    labels = torch.randint(0, classes, (2,))
    dense, steps = None, {}
    for name, mask_at in (("dense", None), ("fold", "parameters"), ("activation", "activation")):
        model = copy.deepcopy(base)
        pruner = None
        if mask_at is not None:
            pruner = DTPPruner(
                model, images[:1], 0.5, mask_at=mask_at, backend="cpu", epilogue_backend="cpu"
            )
        optimizer = make_optimizer(model, {"lr": 0.01}, pruner)
        for group in optimizer.param_groups:
            group["foreach"] = True
        if pruner is not None:
            pruner.attach(optimizer)
        training_step(model, optimizer, images, labels, pruner)  # warm-up
        with CountOps() as mode:
            training_step(model, optimizer, images, labels, pruner)
        total = sum(mode.counts.values())
        allocations = mode.allocations
        dense = dense or (total, allocations)
        more_ops, more_allocations = total / dense[0] - 1, allocations / dense[1] - 1
        lines.append(
            f"{name:>10}: {total} ops ({100 * more_ops:+.1f}%), "
            f"{allocations} allocations ({100 * more_allocations:+.1f}%)"
        )
        steps[name] = (
            lambda m=model, o=optimizer, p=pruner: training_step(m, o, images, labels, p),
            1,
        )
    if args.time:
        samples = interleaved(steps, args.rounds, torch.device("cpu"), warmup=5)
        base_ms = summarize(samples["dense"])["median_us"] / 1e3
        for name, values in samples.items():
            ms = summarize(values)["median_us"] / 1e3
            lines.append(f"{name:>10}: {ms:.3f} ms per step ({ms - base_ms:+.3f} ms)")
    print("\n".join(lines))
    if args.save:
        env = environment(torch.device("cpu"))
        header = (
            f"## {args.label + ': ' if args.label else ''}{args.model}, batch 2, "
            f"{args.size}x{args.size}"
            f"{f', {args.rounds} interleaved steps' if args.time else ''}\n\n"
            f"{env['device']}; torch {env['torch']}; {env['date']}\n"
        )
        with (RESULTS / "step_ops_cpu.md").open("a") as f:
            f.write(header + "\n```\n" + "\n".join(lines) + "\n```\n\n")


if __name__ == "__main__":
    main()
