"""`make demo-transformers`: DTP on transformers, offline, against the magnitude (L1)
baseline at the same kept counts and the same training budget after pruning.

- a small ViT (timm) on scikit-learn's digits (8x8 images, 2x2 patches), pruned to half
  its heads and half its MLP neurons: test accuracy;
- a small Llama (Hugging Face transformers) trained on bytes of the Python standard
  library's own source, pruned to half its key/value heads (with their query heads) and
  half its MLP neurons: perplexity on held-out files;
- a small Mixtral (8 experts, 2 per token) on the same bytes, pruned to half its
  experts (whole experts, the router's rows with them): perplexity on held-out files.

DTP trains the pruning stage with its masks, then the exported model fine-tunes; the
baseline prunes the same model one-shot and fine-tunes for the pruning stage's steps and
the fine-tuning steps together.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .pruning import L1Pruner, prepare
from .pruning.cost import count_params

RATIOS = {"heads": 0.5, "mlp": 0.5}
EXPERT_RATIOS = {"whole_experts": 0.5}


# ---- data ---------------------------------------------------------------------------


def digits_data(seed: int) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits as (1, 8, 8) images in [0, 1]: train/test split 3:1."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = len(y) * 3 // 4
    train, test = order[:split], order[split:]
    return x[train], y[train], x[test], y[test]


def stdlib_bytes(limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the standard library's top-level modules: the files in name order until
    `limit` bytes for training, then the next files up to a tenth of that, held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train, held_out = bytearray(), bytearray()
    for path in files:
        target = train if len(train) < limit else held_out
        target.extend(path.read_bytes())
        if len(held_out) >= limit // 10:
            break
    return (
        torch.frombuffer(train, dtype=torch.uint8).long(),
        torch.frombuffer(held_out, dtype=torch.uint8).long(),
    )


def batches(x: torch.Tensor, y: torch.Tensor, size: int, generator) -> Iterator[tuple]:
    order = torch.randperm(len(y), generator=generator)
    for start in range(0, len(y), size):
        index = order[start : start + size]
        yield x[index], y[index]


def windows(data: torch.Tensor, length: int, count: int, generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - length - 1, (count,), generator=generator)
    return torch.stack([data[s : s + length + 1] for s in starts.tolist()])


# ---- the comparison, for any model and training step ----------------------------------


def compare(
    dense: nn.Module,
    example: tuple,
    train_steps: Callable[[nn.Module, torch.optim.Optimizer, int], None],
    new_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    evaluate: Callable[[nn.Module], float],
    prune_steps: int,
    finetune_steps: int,
    ratios: dict = RATIOS,
) -> list[dict]:
    """Rows for the dense model, DTP and L1 at `ratios` (same kept counts, same steps)."""
    rows = [{"method": "dense", "metric": evaluate(dense), "params": count_params(dense)}]
    for method in ("dtp", "l1"):
        start = time.perf_counter()
        model = copy.deepcopy(dense)
        if method == "dtp":  # prune stage: the masks learn while the model trains
            optimizer = new_optimizer(model)
            pruner = prepare(model, optimizer, example, ratios)
            train_steps(model, optimizer, prune_steps)
            small, steps = pruner.export(), finetune_steps
        else:
            small, steps = L1Pruner(model, example, ratios).export(), prune_steps + finetune_steps
        train_steps(small, new_optimizer(small), steps)
        rows.append(
            {
                "method": method,
                "metric": evaluate(small),
                "params": count_params(small),
                "seconds": time.perf_counter() - start,
            }
        )
    return rows


def vit_digits(seed: int = 0, epochs: tuple[int, int, int] = (40, 10, 10)) -> list[dict]:
    """Pretrain a small ViT on digits, then compare DTP and L1 (accuracy)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    x, y, x_test, y_test = digits_data(seed)
    model = VisionTransformer(
        img_size=8,
        patch_size=2,
        in_chans=1,
        num_classes=10,
        embed_dim=64,
        depth=4,
        num_heads=4,
        mlp_ratio=2.0,
    )
    generator = torch.Generator().manual_seed(seed)

    def train_epochs(net: nn.Module, optimizer, epochs: int) -> None:
        net.train()
        for _ in range(epochs):
            for xb, yb in batches(x, y, 64, generator):
                loss = nn.functional.cross_entropy(net(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

    def accuracy(net: nn.Module) -> float:
        net.eval()
        with torch.no_grad():
            return float((net(x_test).argmax(1) == y_test).float().mean())

    def adam(net: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.05)

    train_epochs(model, adam(model), epochs[0])
    return compare(model, (x[:1],), train_epochs, adam, accuracy, epochs[1], epochs[2])


@dataclass
class LlamaTask:
    """A small byte-level Llama on stdlib source with its training and evaluation."""

    model: nn.Module
    train_steps: Callable[[nn.Module, torch.optim.Optimizer, int], None]
    perplexity: Callable[[nn.Module], float]
    new_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    example: tuple
    generator: torch.Generator  # draws the training windows; its state can be reset


def llama_task(seed: int = 0, experts: int = 0) -> LlamaTask:
    """The Llama (2 layers, 4 query / 2 key-value heads, hidden 64) from random weights,
    its training on 32 windows of 64 bytes per step and its held-out perplexity. With
    `experts`: a Mixtral, that many experts of 96 neurons (2 per token) for each MLP."""
    import transformers

    torch.manual_seed(seed)
    train, held_out = stdlib_bytes(1_500_000)
    sizes: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model: transformers.PreTrainedModel
    if experts:
        config = transformers.MixtralConfig(
            **sizes, intermediate_size=96, num_local_experts=experts, num_experts_per_tok=2
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**sizes, intermediate_size=192)
        )
    generator = torch.Generator().manual_seed(seed)
    evaluation = windows(held_out, 64, 256, torch.Generator().manual_seed(seed + 1))

    def train_steps(net: nn.Module, optimizer, count: int) -> None:
        net.train()
        for _ in range(count):
            tokens = windows(train, 64, 32, generator)
            loss = net(tokens, labels=tokens).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def perplexity(net: nn.Module) -> float:
        net.eval()
        with torch.no_grad():
            losses = [net(part, labels=part).loss for part in evaluation.split(64)]
        return math.exp(float(torch.stack(losses).mean()))

    def adam(net: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)

    return LlamaTask(model, train_steps, perplexity, adam, (evaluation[:1],), generator)


def llama_stdlib(
    seed: int = 0, steps: tuple[int, int, int] = (600, 150, 150), experts: int = 0
) -> list[dict]:
    """Pretrain the small Llama (llama_task), then compare DTP and L1 (perplexity) at
    RATIOS; with `experts`, the small Mixtral at EXPERT_RATIOS."""
    task = llama_task(seed, experts)
    task.train_steps(task.model, task.new_optimizer(task.model), steps[0])
    return compare(
        task.model,
        task.example,
        task.train_steps,
        task.new_optimizer,
        task.perplexity,
        steps[1],
        steps[2],
        EXPERT_RATIOS if experts else RATIOS,
    )


def summarize(runs: list[list[dict]]) -> list[dict]:
    """Per method: the metric's mean and standard deviation over the seeds' runs."""
    rows = []
    for index, first in enumerate(runs[0]):
        values = torch.tensor([run[index]["metric"] for run in runs], dtype=torch.float64)
        seconds = [run[index]["seconds"] for run in runs if "seconds" in run[index]]
        rows.append(
            {
                **first,
                "metric": float(values.mean()),
                "std": float(values.std()) if len(runs) > 1 else 0.0,
                "seconds": sum(seconds) / len(seconds) if seconds else None,
            }
        )
    return rows


def print_rows(title: str, metric: str, rows: list[dict], percent: bool) -> None:
    print(title)
    print(f"{'method':>7} {metric:>18} {'params':>9} {'seconds':>8}")
    for row in rows:
        scale, unit = (100, "%") if percent else (1, "")
        value = f"{row['metric'] * scale:.2f}{unit} ± {row['std'] * scale:.2f}"
        seconds = f"{row['seconds']:.1f}" if row["seconds"] is not None else "-"
        print(f"{row['method']:>7} {value:>18} {row['params']:>9d} {seconds:>8}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args(argv)
    print(
        f"DTP vs L1 at {RATIOS}, same kept counts and steps (torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}, seeds {args.seeds}; mean ± std over seeds)\n"
    )
    print_rows(
        "ViT (timm, 4 blocks of 4 heads) on scikit-learn digits, 2x2 patches: test accuracy",
        "accuracy",
        summarize([vit_digits(seed) for seed in args.seeds]),
        percent=True,
    )
    print()
    print_rows(
        "Llama (transformers, 2 layers, 4 query / 2 key-value heads) on stdlib bytes: "
        "held-out perplexity",
        "perplexity",
        summarize([llama_stdlib(seed) for seed in args.seeds]),
        percent=False,
    )
    print()
    print_rows(
        f"Mixtral (transformers, 2 layers of 8 experts, 2 per token) on stdlib bytes at "
        f"{EXPERT_RATIOS}: held-out perplexity",
        "perplexity",
        summarize([llama_stdlib(seed, experts=8) for seed in args.seeds]),
        percent=False,
    )


if __name__ == "__main__":
    main()
