"""The literal reference: the paper's Algorithm 1 for one segment, in float64.

This module is the oracle every fast path is tested against. It works on the n x 2
plan P and the dual variables f, g exactly as Algorithm 1 writes them, in the log
domain, and lets autograd differentiate through all of it. It imports nothing from the
rest of the package.

One step, for scores s (n), kept count k, previous plan P and dual g, and eps:

    C_ij = (s_i - m_j)^2 with m = (0, 1);  K = exp(-C / eps) * P
    repeat iters times:
        f = eps log a - eps log(K exp(g / eps))          a = 1/n
        g = eps log b - eps log(K^T exp(f / eps))        b = (1 - k/n, k/n)
    P_new = exp(f / eps) * K * exp(g / eps);  mask = n P_new[:, 1]

A segment with k = 0 or k = n has one feasible plan, P = a b^T, so its mask is k/n
everywhere and the carried plan is left as it was (the log-domain updates would take
log 0 there).
"""

from __future__ import annotations

import math

import torch

DTYPE = torch.float64
SUPPORTS = torch.tensor([0.0, 1.0], dtype=DTYPE)  # m_0 (pruned), m_1 (kept)


def cost_matrix(scores: torch.Tensor) -> torch.Tensor:
    """C(s): n x 2 squared distances of each score to the supports 0 and 1."""
    return (scores[:, None] - SUPPORTS.to(scores.device)[None, :]) ** 2


def plan_from_state(log_odds: torch.Tensor) -> torch.Tensor:
    """A log plan whose rows have the given log-odds (row scale does not matter)."""
    d = log_odds.to(DTYPE)
    n = d.numel()
    return torch.stack(
        [torch.nn.functional.logsigmoid(-d), torch.nn.functional.logsigmoid(d)], 1
    ) - math.log(n)


def sinkhorn_step(
    scores: torch.Tensor,
    keep: torch.Tensor,
    log_plan: torch.Tensor,
    g: torch.Tensor,
    eps: float,
    iters: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 1 for one segment: returns (mask, new log plan, new g).

    scores: (n,), keep: 0-d tensor k in [0, n], log_plan: (n, 2) log P of the previous
    step, g: (2,) dual of the previous step. Everything is computed in float64.
    """
    s = scores.to(DTYPE)
    k = keep.to(DTYPE)
    n = s.numel()
    if not bool((k > 0) & (k < n)):
        mask = (k / n).expand(n)
        return mask, log_plan.to(DTYPE), g.to(DTYPE)
    log_a = torch.full((n,), -math.log(n), dtype=DTYPE, device=s.device)
    log_b = torch.stack([torch.log1p(-k / n), torch.log(k / n)])
    log_k = -cost_matrix(s) / eps + log_plan.to(DTYPE)
    g = g.to(DTYPE)
    for _ in range(iters):
        f = eps * log_a - eps * torch.logsumexp(log_k + g[None, :] / eps, dim=1)
        g = eps * log_b - eps * torch.logsumexp(log_k + f[:, None] / eps, dim=0)
    new_log_plan = f[:, None] / eps + log_k + g[None, :] / eps
    mask = n * torch.exp(new_log_plan[:, 1])
    return mask, new_log_plan, g


def transport_mask_segments(
    scores: list[torch.Tensor],
    keep: torch.Tensor,
    log_odds: list[torch.Tensor],
    shift: torch.Tensor,
    eps: list[float],
    iters: int = 1,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[bool]]:
    """Algorithm 1 looped over segments, on the compact state of TransportState.

    Converts each segment's (log_odds, shift) to a plan and a dual g, runs
    :func:`sinkhorn_step`, and converts back. A segment whose new state is not finite
    keeps its old state. Returns (masks, new log-odds, new shifts, held), all float64
    but ``held``: per segment, whether it kept its old state for that reason.
    """
    masks, new_log_odds, new_shift, held = [], [], [], []
    for index, s in enumerate(scores):
        e = float(eps[index])
        g = torch.stack(
            [torch.zeros((), dtype=DTYPE, device=shift.device), shift[index].to(DTYPE) * e]
        )
        g = g.to(s.device)
        mask, log_plan, g_new = sinkhorn_step(
            s, keep[index], plan_from_state(log_odds[index]), g, e, iters
        )
        d_new = (log_plan[:, 1] - log_plan[:, 0]).detach()
        delta_new = ((g_new[1] - g_new[0]) / e).detach()
        held.append(not bool(torch.isfinite(d_new).all() and torch.isfinite(delta_new)))
        if held[-1]:
            d_new, delta_new = log_odds[index].to(DTYPE), shift[index].to(DTYPE)
        masks.append(mask)
        new_log_odds.append(d_new)
        new_shift.append(delta_new)
    return masks, new_log_odds, torch.stack(new_shift), held
