"""`make demo`: the paper's Fig. 2 toy, printed as a mask trajectory.

Keep 1 of 3 weights w = (2, 1, 3) by learning a soft mask m with loss w . m and SGD on
the scores; DTP's one-step transport drives the mask to the hard (0, 1, 0), loss 1.
"""

from __future__ import annotations

import argparse

import torch

from .transport_mask import transport_mask
from .transport_state import TransportState


def fig2_toy(
    steps: int = 200, lr: float = 0.1, eps: float = 1.0, backend: str = "auto"
) -> list[tuple[int, list[float], float]]:
    """Run the toy; return (step, mask, loss) for every step."""
    weights = torch.tensor([2.0, 1.0, 3.0])
    scores = torch.full((3,), 0.5, requires_grad=True)  # no preference at the start
    state = TransportState([3])
    optimizer = torch.optim.SGD([scores], lr=lr)
    trajectory = []
    for step in range(steps):
        mask = transport_mask(scores, [1.0], state, eps=eps, backend=backend)
        loss = (weights * mask).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.commit()
        trajectory.append((step, mask.detach().tolist(), loss.item()))
    return trajectory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--eps", type=float, default=1.0)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    trajectory = fig2_toy(args.steps, args.lr, args.eps, args.backend)
    print("DTP, paper Fig. 2 toy: keep 1 of w = (2, 1, 3), loss = w . mask")
    print(f"{'step':>6}  {'m1':>8} {'m2':>8} {'m3':>8}  {'sum':>6}  {'loss':>8}")
    shown = {0, 1, 2, 5, 10, 20, 50, 100, args.steps - 1} | set(range(0, args.steps, 25))
    for step, mask, loss in trajectory:
        if step in shown:
            m = "".join(f" {v:8.4f}" for v in mask)
            print(f"{step:>6} {m}  {sum(mask):6.3f}  {loss:8.4f}")
    final = trajectory[-1][1]
    hard = [round(v) for v in final]
    rounded = [round(v, 4) for v in final]
    print(f"final mask {rounded} -> hard mask {hard}, loss {trajectory[-1][2]:.4f}")


if __name__ == "__main__":
    main()
