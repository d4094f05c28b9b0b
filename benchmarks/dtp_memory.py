"""Memory of DTP's whole state per pruned weight: scores, their gradient and optimizer
state, the transport state (current and pending), the kept counts, and what a step keeps
from its forward for its backward, for unstructured (one segment per layer) and N:M
pruning of the same layers, with learned scores (a parameter of the pruner) and with
magnitude scores (`scores="magnitude"`: |w| computed every forward, no score parameter).

    python benchmarks/dtp_memory.py [--weights N] [--no-save]

Counts the bytes of the tensors' storages, each once (a view expand()ed over the
segments, as a float eps and the N:M kept count are, weighs its one value), after one
training step with SGD with momentum and with Adam; writes results/dtp_memory_cpu.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, environment

from dtp_kernels.pruning import DTPPruner


def nbytes(tensors) -> int:
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t is not None
    }
    return sum(storages.values())


def eps_cache(pruner: DTPPruner) -> list[torch.Tensor]:
    """The eps tensor the transport state keeps once a step has run (float64: one value
    expand()ed over the segments for a float eps; not a buffer, but state all the same)."""
    cached = pruner.state._eps_cache
    return [] if cached is None else [cached[1]]


def owned_storages(*modules: nn.Module, extra: Sequence[torch.Tensor] = ()) -> set[int]:
    """Data pointers of the storages the modules own (parameters, buffers) and of `extra`."""
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())] + list(extra)
    return {t.untyped_storage().data_ptr() for t in tensors}


def forward_saving(model: nn.Module, example: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A forward's loss and the storages autograd saved for its backward (data pointer
    -> bytes; a view counts its whole storage, each storage once)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(example).pow(2).mean()
    return loss, saved


def kept_bytes(saved: dict[int, int], owned: set[int]) -> int:
    return sum(size for ptr, size in saved.items() if ptr not in owned)


def state_bytes(
    pruner: DTPPruner, optimizer: torch.optim.Optimizer, forward_to_backward: int
) -> dict[str, int]:
    """Bytes of each part of DTP's state, after a step (gradients and optimizer state
    exist)."""
    state = pruner.state
    transport = [b for name, b in state.named_buffers() if not name.startswith("pending")]
    pending = [b for name, b in state.named_buffers() if name.startswith("pending")]
    learned = pruner.scores is not None
    optim = optimizer.state.get(pruner.scores, {}) if learned else {}
    return {
        "scores": nbytes([pruner.scores]),
        "score gradient": nbytes([pruner.scores.grad]) if learned else 0,
        "optimizer state": nbytes(v for v in optim.values() if isinstance(v, torch.Tensor)),
        "transport state": nbytes(transport + eps_cache(pruner)),
        "pending state": nbytes(pending),
        "kept counts": nbytes([pruner.keep]),
        "forward-to-backward": forward_to_backward,
    }


def measure(
    weights: int, granularity: str, optimizer_name: str, scores: str
) -> tuple[int, dict[str, int]]:
    """One SGD or Adam step of a pruned three-layer MLP; forward-to-backward is measured:
    what the pruned model's forward saves for its backward beyond what the same dense
    model's forward saves, parameters, buffers and the state's own tensors left out (the
    mask, the masked weights, the step's statistics, |w| for magnitude scores)."""
    width = max(16, int((weights / 3) ** 0.5) // 16 * 16)
    layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, width))
    example = torch.randn(2, width)
    _, dense_saved = forward_saving(model, example)
    dense = kept_bytes(dense_saved, owned_storages(model))
    options = {"granularity": "n:m"} if granularity == "2:4" else {"granularity": "weight"}
    pruner = DTPPruner(model, example, 0.5, scores=scores, **options)
    params = [*model.parameters(), *pruner.parameters()]
    optimizer = (
        torch.optim.SGD(params, lr=0.01, momentum=0.9)
        if optimizer_name == "SGD"
        else torch.optim.Adam(params, lr=1e-3)
    )
    loss, saved = forward_saving(model, example)
    extra = kept_bytes(saved, owned_storages(model, pruner, extra=eps_cache(pruner))) - dense
    loss.backward()
    optimizer.step()
    return pruner.state.numel, state_bytes(pruner, optimizer, extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=int, default=1 << 20)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    env = environment(torch.device("cpu"))
    lines = [
        "# Memory of DTP's state per pruned weight (`benchmarks/dtp_memory.py`)",
        "",
        f"torch {env['torch']}; {env['date']}; three Linear layers, float32 weights; "
        "bytes per pruned weight after one step; iters = 1. Transport state: log-odds, "
        "shift, offsets, step counts and eps; forward-to-backward: measured, what the "
        "pruned forward saves for its backward beyond the dense forward.",
        "",
    ]
    header = None
    cases = [
        (scores, granularity, optimizer_name)
        for scores in ("learned", "magnitude")
        for granularity in ("weight", "2:4")
        for optimizer_name in ("SGD", "Adam")
    ]
    for scores, granularity, optimizer_name in cases:
        count, parts = measure(args.weights, granularity, optimizer_name, scores)
        if header is None:
            header = ["scores", "granularity", "optimizer", *parts, "total"]
            lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        cells = [f"{b / count:.2f}" for b in parts.values()]
        total = sum(parts.values()) / count
        row = [scores, granularity, optimizer_name, *cells, f"{total:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        (RESULTS / "dtp_memory_cpu.md").write_text(report)


if __name__ == "__main__":
    main()
