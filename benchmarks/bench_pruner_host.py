"""The pruner's own host work per training step on torchvision's ResNet-50: the forward
pre-hook (mask step forward, BN fold) and the commit after the optimizer step, with the
fold as one C++ autograd node (what DTPPruner runs when dtp_kernels._C is built) and as
the Python ops, in one run. Single calls on one thread, CPU tensors, the parts
interleaved in rounds. On a GPU (--device cuda) each call is timed without a sync, so the
figures are the host's time to issue the work (the GPU catches up between rounds).

    python benchmarks/bench_pruner_host.py [--device cpu|cuda] [--rounds N] [--no-save]

Writes results/pruner_host_<device>.md.
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


def interleaved_medians(
    calls: dict, rounds: int, device: torch.device, per_round: int = 50
) -> dict:
    """Each call's median time in us: rounds of `per_round` calls of each in turn, the
    median of each round's median (the machine's speed drifts between rounds)."""
    for call in calls.values():
        for _ in range(20):
            call()
    medians = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # host time only: no queue left from before
            times = []
            for _ in range(per_round):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times))
    return {name: 1e6 * statistics.median(m) for name, m in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=40, help="rounds of 50 calls of each")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if _C is None:
        raise SystemExit("bench_pruner_host.py needs dtp_kernels._C (make build)")
    import torchvision

    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = torchvision.models.resnet50().to(device)
    pruner = DTPPruner(model, torch.randn(1, 3, 64, 64, device=device), 0.5)
    model.train()
    originals = pruner._fold_originals
    pruner._compute_masks(model, ())
    flat, plan = pruner._source.flat, pruner._fold_plan

    def pre_hook() -> None:
        pruner._compute_masks(model, ())
        pruner._source.release_graph()

    rows = interleaved_medians(
        {
            "forward pre-hook (mask step + fold)": pre_hook,
            "mask step forward": lambda: pruner._transport(update=True),
            "fold, C++ node": lambda: _C.fold_products(originals, flat, plan.channels),
            "fold, Python ops": lambda: folded_products(flat, plan, originals),
            "commit (after the optimizer step)": pruner.state.commit,
        },
        args.rounds,
        device,
    )
    env = environment(device)
    lines = [
        "# The pruner's host work per step (`benchmarks/bench_pruner_host.py`)",
        "",
        f"{env['device']}, 1 thread; torch {env['torch']}; {env['date']}; torchvision "
        f"ResNet-50, {len(pruner.groups)} groups, {len(originals)} folded BN parameters; "
        f"{args.rounds} interleaved rounds of 50 calls, median of the rounds' medians.",
        "",
        "| part | us |",
        "| --- | ---: |",
        *(f"| {name} | {us:.1f} |" for name, us in rows.items()),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        (RESULTS / f"pruner_host_{device.type}.md").write_text(report)


if __name__ == "__main__":
    main()
