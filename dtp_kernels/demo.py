"""`make demo`: prune a small CNN on scikit-learn's digits at 50% and 90% of its filters
with DTP and with L1 one-shot pruning, at the same kept counts and the same fine-tuning
budget, and print one table. `--toy` prints the paper's Fig. 2 toy instead.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from .transport_mask import transport_mask
from .transport_state import TransportState


def fig2_toy(
    steps: int = 200, lr: float = 0.1, eps: float = 1.0, iters: int = 1, backend: str = "auto"
) -> list[tuple[int, list[float], float, list[float]]]:
    """Paper Fig. 2: keep 1 of w = (2, 1, 3) with loss w . mask; rows of (step, mask, loss,
    scores), the scores as they entered that step."""
    weights = torch.tensor([2.0, 1.0, 3.0])
    scores = torch.full((3,), 0.5, requires_grad=True)  # no preference at the start
    state = TransportState([3])
    optimizer = torch.optim.SGD([scores], lr=lr)
    trajectory = []
    for step in range(steps):
        entered = scores.detach().tolist()
        mask = transport_mask(scores, [1.0], state, eps=eps, iters=iters, backend=backend)
        loss = (weights * mask).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.commit()
        trajectory.append((step, mask.detach().tolist(), loss.item(), entered))
    return trajectory


def print_toy(steps: int = 200) -> None:
    trajectory = fig2_toy(steps)
    print("DTP, paper Fig. 2 toy: keep 1 of w = (2, 1, 3), loss = w . mask")
    print(f"{'step':>6}  {'m1':>8} {'m2':>8} {'m3':>8}  {'sum':>6}  {'loss':>8}")
    shown = {0, 1, 2, 5, 10, 20, 50, 100, steps - 1} | set(range(0, steps, 25))
    for step, mask, loss, _scores in trajectory:
        if step in shown:
            m = "".join(f" {v:8.4f}" for v in mask)
            print(f"{step:>6} {m}  {sum(mask):6.3f}  {loss:8.4f}")
    final = trajectory[-1][1]
    rounded = [round(v, 4) for v in final]
    hard = [round(v) for v in final]
    print(f"final mask {rounded} -> hard mask {hard}, loss {trajectory[-1][2]:.4f}")


DEFAULT_VARIANTS = [{"ratios": r, "method": m} for r in (0.5, 0.9) for m in ("dtp", "l1")]


def digits_comparison(
    epochs: int = 12, seed: int = 0, variants: list[dict] | None = None
) -> list[dict]:
    """Pre-train once; then for each variant (recipe["prune"] updates: method, ratios,
    iters, ...) prune, fine-tune the same epochs, evaluate. The first row is the dense
    model."""
    from .models import get_model
    from .pipeline import recipe as recipes
    from .pipeline.run import build_data, prune_and_finetune
    from .pipeline.train import MetricsLog, evaluate, train

    torch.manual_seed(seed)
    stages = ("pretrain", "prune", "finetune")
    recipe = recipes.load(None, [f"seed={seed}", *(f"{s}.epochs={epochs}" for s in stages)])
    train_loader, test_loader = build_data(recipe)
    dense = get_model("digits_cnn")
    log = MetricsLog()
    start = time.perf_counter()
    train(dense, train_loader, test_loader, recipe["pretrain"], log, "pretrain")
    rows = [
        {
            "method": "dense",
            "ratio": 0.0,
            "accuracy": evaluate(dense, test_loader),
            "seconds": {"pretrain": time.perf_counter() - start},
        }
    ]
    for variant in variants or DEFAULT_VARIANTS:
        torch.manual_seed(seed)
        run = copy.deepcopy(recipe)
        run["prune"].update(variant)
        summary = prune_and_finetune(dense, run, train_loader, test_loader, log)
        rows.append({**summary, **variant, "ratio": run["prune"]["ratios"]})
    dense_row = rows[0]
    from .pruning.cost import count_flops, count_params

    example = next(iter(test_loader))[0][:1]
    dense_row.update(
        params=count_params(dense), flops=count_flops(dense, example), sparsity=0.0, speedup=1.0
    )
    return rows


def print_comparison(rows: list[dict]) -> None:
    print("Digits (scikit-learn, 8x8), small CNN: DTP vs L1 one-shot, same kept counts and")
    print("the same fine-tuning epochs; accuracy on the held-out quarter.")
    columns = ("method", "pruned", "accuracy", "params", "FLOPs", "speed-up")
    widths = (7, 7, 9, 8, 9, 9)
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)), end="")
    print("  wall time per stage (s)")
    for row in rows:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in row["seconds"].items())
        print(
            f"{row['method']:>7} {row['ratio']:>7.0%} {row['accuracy']:>9.2%} "
            f"{row['params']:>8d} {row['flops']:>9d} {row['speedup']:>8.2f}x  {stages}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="print the Fig. 2 toy instead")
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args(argv)
    if args.toy:
        print_toy()
        return
    print_comparison(digits_comparison(args.epochs))


if __name__ == "__main__":
    main()
