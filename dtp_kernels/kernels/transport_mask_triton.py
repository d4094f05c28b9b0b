"""Triton kernels of the DTP transport-mask step, one Sinkhorn iteration (iters = 1).

Forward and backward are one launch each. Segments of any size: program p handles
segment p: a first loop
over BLOCK-sized chunks builds the per-chunk max and sum-exp of both columns and merges
them in chunk order (online log-sum-exp; no atomics, so results are bitwise
reproducible), a second loop writes the mask and the next state. Segments all of one
tiny size (segment_size 4, 8 or 16, N:M blocks): a program takes a tile of them. The math
follows
docs/design.md section 1 and csrc/transport_math.h; it runs in fp32 (fp64 for fp64 scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _log_sigmoid(z):
    # min(z, 0) - log(1 + exp(-|z|)), stable for any z; NaN propagates
    return tl.where(z > 0, 0.0, z) - tl.log(1.0 + tl.exp(-tl.abs(z)))


@triton.jit
def _load_scores(scores_ptr, idx, valid, ACC: tl.constexpr, NEUTRAL: tl.constexpr):
    """(scores as used, whether each raw score is finite). NEUTRAL: a non-finite score
    enters as 0.5."""
    raw = tl.load(scores_ptr + idx, mask=valid, other=0.0).to(ACC)
    ok = raw - raw == 0.0  # False for inf and NaN
    if NEUTRAL:
        raw = tl.where(ok, raw, 0.5)
    return raw, ok


@triton.jit
def _transport_mask_fwd_kernel(
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    log_odds_ptr,
    shift_ptr,
    mask_ptr,
    new_log_odds_ptr,
    new_shift_ptr,
    stats_ptr,
    nonfinite_ptr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    n = (end - start).to(ACC)
    k = tl.load(keep_ptr + seg).to(ACC)
    inv_eps = 1.0 / tl.load(eps_ptr + seg).to(ACC)
    delta = tl.load(shift_ptr + seg).to(ACC)
    lanes = tl.arange(0, BLOCK)

    # Pass 1: log-sum-exp of both columns, chunk partials merged in chunk order.
    m1 = tl.full((), float("-inf"), ACC)
    s1 = tl.zeros((), ACC)
    m0 = tl.full((), float("-inf"), ACC)
    s0 = tl.zeros((), ACC)
    bad = tl.zeros((), tl.int32)
    for chunk in range(start, end, BLOCK):
        idx = chunk + lanes
        valid = idx < end
        s, s_ok = _load_scores(scores_ptr, idx, valid, ACC, NEUTRAL)
        d = tl.load(log_odds_ptr + idx, mask=valid, other=0.0).to(ACC)
        x = d + (2.0 * s - 1.0) * inv_eps
        bad += tl.sum(tl.where(valid & ((x - x != 0.0) | ~s_ok), 1, 0), axis=0)  # inf or NaN
        z = x + delta
        l1 = tl.where(valid, _log_sigmoid(z), float("-inf"))
        l0 = tl.where(valid, _log_sigmoid(-z), float("-inf"))
        cm1 = tl.max(l1, axis=0)
        cm0 = tl.max(l0, axis=0)
        cs1 = tl.sum(tl.exp(l1 - cm1), axis=0)
        cs0 = tl.sum(tl.exp(l0 - cm0), axis=0)
        nm1 = tl.maximum(m1, cm1)
        nm0 = tl.maximum(m0, cm0)
        s1 = s1 * tl.exp(m1 - nm1) + cs1 * tl.exp(cm1 - nm1)
        s0 = s0 * tl.exp(m0 - nm0) + cs0 * tl.exp(cm0 - nm0)
        m1 = nm1
        m0 = nm0
    lse1 = m1 + tl.log(s1)
    lse0 = m0 + tl.log(s0)

    # k = 0 or k = n: one feasible plan, mask k/n, state kept (docs/design.md; reference.py).
    degenerate = (k <= 0.0) | (k >= n)
    k_safe = tl.where(degenerate, n * 0.5, k)
    new_delta = tl.log(k_safe) - tl.log(n - k_safe) + delta - lse1 + lse0
    nonfinite = (bad != 0) | (new_delta - new_delta != 0.0)
    advance = ~nonfinite & ~degenerate

    # Pass 2: mask and next state.
    for chunk in range(start, end, BLOCK):
        idx = chunk + lanes
        valid = idx < end
        s, _ = _load_scores(scores_ptr, idx, valid, ACC, NEUTRAL)
        d = tl.load(log_odds_ptr + idx, mask=valid, other=0.0).to(ACC)
        x = d + (2.0 * s - 1.0) * inv_eps
        mask = k * tl.exp(_log_sigmoid(x + delta) - lse1)
        mask = tl.where(degenerate, k / n, mask)
        tl.store(mask_ptr + idx, mask.to(mask_ptr.dtype.element_ty), mask=valid)
        new_d = tl.where(advance, x + new_delta, d)
        tl.store(new_log_odds_ptr + idx, new_d.to(new_log_odds_ptr.dtype.element_ty), mask=valid)
    tl.store(
        new_shift_ptr + seg, tl.where(advance, new_delta, delta).to(new_shift_ptr.dtype.element_ty)
    )
    tl.store(stats_ptr + 3 * seg, delta.to(stats_ptr.dtype.element_ty))
    tl.store(stats_ptr + 3 * seg + 1, lse1.to(stats_ptr.dtype.element_ty))
    tl.store(stats_ptr + 3 * seg + 2, lse0.to(stats_ptr.dtype.element_ty))
    tl.store(nonfinite_ptr + seg, nonfinite)


@triton.jit
def _transport_mask_bwd_kernel(
    grad_mask_ptr,
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    log_odds_ptr,
    stats_ptr,
    grad_scores_ptr,
    grad_keep_ptr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    n = (end - start).to(ACC)
    k = tl.load(keep_ptr + seg).to(ACC)
    inv_eps = 1.0 / tl.load(eps_ptr + seg).to(ACC)
    delta = tl.load(stats_ptr + 3 * seg).to(ACC)
    lse1 = tl.load(stats_ptr + 3 * seg + 1).to(ACC)
    degenerate = (k <= 0.0) | (k >= n)
    lanes = tl.arange(0, BLOCK)

    # Pass 1: sum_i g_i p_i (p = mask / k) and sum_i g_i, in chunk order.
    gp = tl.zeros((), ACC)
    gs = tl.zeros((), ACC)
    for chunk in range(start, end, BLOCK):
        idx = chunk + lanes
        valid = idx < end
        s, _ = _load_scores(scores_ptr, idx, valid, ACC, NEUTRAL)
        d = tl.load(log_odds_ptr + idx, mask=valid, other=0.0).to(ACC)
        g = tl.load(grad_mask_ptr + idx, mask=valid, other=0.0).to(ACC)
        z = d + (2.0 * s - 1.0) * inv_eps + delta
        p = tl.exp(_log_sigmoid(z) - lse1)
        gp += tl.sum(tl.where(valid, g * p, 0.0), axis=0)
        gs += tl.sum(g, axis=0)

    # Pass 2: d score_i = (2 / eps) k sigmoid(z) sigmoid(-z) / S1 (g_i - sum g p).
    scale = 2.0 * inv_eps * k
    for chunk in range(start, end, BLOCK):
        idx = chunk + lanes
        valid = idx < end
        s, s_ok = _load_scores(scores_ptr, idx, valid, ACC, NEUTRAL)
        d = tl.load(log_odds_ptr + idx, mask=valid, other=0.0).to(ACC)
        g = tl.load(grad_mask_ptr + idx, mask=valid, other=0.0).to(ACC)
        z = d + (2.0 * s - 1.0) * inv_eps + delta
        q = tl.exp(_log_sigmoid(z) + _log_sigmoid(-z) - lse1)
        grad = tl.where(degenerate, 0.0, scale * q * (g - gp))  # 0 even where q is NaN
        if NEUTRAL:
            grad = tl.where(s_ok, grad, 0.0)  # a score read as 0.5 gets no gradient
        tl.store(grad_scores_ptr + idx, grad.to(grad_scores_ptr.dtype.element_ty), mask=valid)
    grad_keep = tl.where(degenerate, gs / n, gp)
    tl.store(grad_keep_ptr + seg, grad_keep.to(grad_keep_ptr.dtype.element_ty))


# ---- segments all of one tiny size M (4, 8, 16; the blocks of N:M sparsity) ----------
#
# Program p handles BLOCK // M consecutive segments as a [segments, M] tile: no offsets
# are read, every sum is a row reduction of the tile, each row in a fixed order.


@triton.jit
def _blocks_tile(
    scores_ptr, log_odds_ptr, keep_ptr, eps_ptr, nseg, ACC, M, SEGS, NEUTRAL: tl.constexpr
):
    """The tile's (index, valid, scores, scores finite, log-odds, x, k, 1 / eps, segments)."""
    seg = tl.program_id(0) * SEGS + tl.arange(0, SEGS)
    idx = seg[:, None] * M + tl.arange(0, M)[None, :]
    valid = (seg < nseg)[:, None] & (idx >= 0)  # (idx >= 0: the tile's shape, always true)
    s, s_ok = _load_scores(scores_ptr, idx, valid, ACC, NEUTRAL)
    d = tl.load(log_odds_ptr + idx, mask=valid, other=0.0).to(ACC)
    k = tl.load(keep_ptr + seg, mask=seg < nseg, other=1.0).to(ACC)
    inv_eps = 1.0 / tl.load(eps_ptr + seg, mask=seg < nseg, other=1.0).to(ACC)
    x = d + (2.0 * s - 1.0) * inv_eps[:, None]
    return idx, valid, s_ok, d, x, k, inv_eps, seg


@triton.jit
def _transport_mask_blocks_fwd_kernel(
    scores_ptr,
    keep_ptr,
    eps_ptr,
    log_odds_ptr,
    shift_ptr,
    mask_ptr,
    new_log_odds_ptr,
    new_shift_ptr,
    stats_ptr,
    nonfinite_ptr,
    nseg,
    ACC: tl.constexpr,
    M: tl.constexpr,
    SEGS: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    idx, valid, s_ok, d, x, k, _inv_eps, seg = _blocks_tile(
        scores_ptr, log_odds_ptr, keep_ptr, eps_ptr, nseg, ACC, M, SEGS, NEUTRAL
    )
    live = seg < nseg
    delta = tl.load(shift_ptr + seg, mask=live, other=0.0).to(ACC)
    bad = tl.sum(tl.where(valid & ((x - x != 0.0) | ~s_ok), 1, 0), axis=1)  # inf or NaN
    z = x + delta[:, None]
    l1 = _log_sigmoid(z)
    l0 = _log_sigmoid(-z)
    m1 = tl.max(l1, axis=1)
    m0 = tl.max(l0, axis=1)
    lse1 = m1 + tl.log(tl.sum(tl.exp(l1 - m1[:, None]), axis=1))
    lse0 = m0 + tl.log(tl.sum(tl.exp(l0 - m0[:, None]), axis=1))

    # k = 0 or k = M: one feasible plan, mask k/M, state kept (as the general kernel).
    degenerate = (k <= 0.0) | (k >= M)
    k_safe = tl.where(degenerate, M * 0.5, k)
    new_delta = tl.log(k_safe) - tl.log(M - k_safe) + delta - lse1 + lse0
    nonfinite = (bad != 0) | (new_delta - new_delta != 0.0)
    advance = ~nonfinite & ~degenerate

    mask = k[:, None] * tl.exp(l1 - lse1[:, None])
    mask = tl.where(degenerate[:, None], (k / M)[:, None], mask)
    tl.store(mask_ptr + idx, mask.to(mask_ptr.dtype.element_ty), mask=valid)
    new_d = tl.where(advance[:, None], x + new_delta[:, None], d)
    tl.store(new_log_odds_ptr + idx, new_d.to(new_log_odds_ptr.dtype.element_ty), mask=valid)
    new_shift = tl.where(advance, new_delta, delta)
    tl.store(new_shift_ptr + seg, new_shift.to(new_shift_ptr.dtype.element_ty), mask=live)
    tl.store(stats_ptr + 3 * seg, delta.to(stats_ptr.dtype.element_ty), mask=live)
    tl.store(stats_ptr + 3 * seg + 1, lse1.to(stats_ptr.dtype.element_ty), mask=live)
    tl.store(stats_ptr + 3 * seg + 2, lse0.to(stats_ptr.dtype.element_ty), mask=live)
    tl.store(nonfinite_ptr + seg, nonfinite, mask=live)


@triton.jit
def _transport_mask_blocks_bwd_kernel(
    grad_mask_ptr,
    scores_ptr,
    keep_ptr,
    eps_ptr,
    log_odds_ptr,
    stats_ptr,
    grad_scores_ptr,
    grad_keep_ptr,
    nseg,
    ACC: tl.constexpr,
    M: tl.constexpr,
    SEGS: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    idx, valid, s_ok, _d, x, k, inv_eps, seg = _blocks_tile(
        scores_ptr, log_odds_ptr, keep_ptr, eps_ptr, nseg, ACC, M, SEGS, NEUTRAL
    )
    live = seg < nseg
    delta = tl.load(stats_ptr + 3 * seg, mask=live, other=0.0).to(ACC)
    lse1 = tl.load(stats_ptr + 3 * seg + 1, mask=live, other=0.0).to(ACC)
    g = tl.load(grad_mask_ptr + idx, mask=valid, other=0.0).to(ACC)
    z = x + delta[:, None]
    ls1 = _log_sigmoid(z)
    p = tl.exp(ls1 - lse1[:, None])
    gp = tl.sum(g * p, axis=1)
    gs = tl.sum(g, axis=1)
    # d score_i = (2 / eps) k sigmoid(z) sigmoid(-z) / S1 (g_i - sum g p)
    degenerate = (k <= 0.0) | (k >= M)
    scale = 2.0 * inv_eps * k
    q = tl.exp(ls1 + _log_sigmoid(-z) - lse1[:, None])
    grad = scale[:, None] * q * (g - gp[:, None])
    grad = tl.where(degenerate[:, None], 0.0, grad)
    if NEUTRAL:
        grad = tl.where(s_ok, grad, 0.0)  # a score read as 0.5 gets no gradient
    tl.store(grad_scores_ptr + idx, grad.to(grad_scores_ptr.dtype.element_ty), mask=valid)
    grad_keep = tl.where(degenerate, gs / M, gp)
    tl.store(grad_keep_ptr + seg, grad_keep.to(grad_keep_ptr.dtype.element_ty), mask=live)


def _acc(scores: torch.Tensor):
    return tl.float64 if scores.dtype == torch.float64 else tl.float32


def transport_mask_forward(
    launch, scores, offsets, keep, eps, log_odds, shift, neutral, segment_size=0
):
    """Allocate outputs and launch the forward; `launch` wraps the kernel (wrap_triton).
    segment_size 4, 8 or 16: every segment has that size, the tile kernel runs."""
    nseg = offsets.shape[0] - 1
    mask = torch.empty_like(scores)
    new_log_odds = torch.empty_like(log_odds)
    new_shift = torch.empty_like(shift)
    stats = torch.empty((nseg, 1, 3), dtype=log_odds.dtype, device=scores.device)
    nonfinite = torch.empty((nseg,), dtype=torch.bool, device=scores.device)
    if segment_size:
        segs = BLOCK // segment_size
        launch(_transport_mask_blocks_fwd_kernel)[(triton.cdiv(nseg, segs),)](
            scores,
            keep,
            eps,
            log_odds,
            shift,
            mask,
            new_log_odds,
            new_shift,
            stats,
            nonfinite,
            nseg,
            ACC=_acc(scores),
            M=segment_size,
            SEGS=segs,
            NEUTRAL=neutral,
        )
        return mask, new_log_odds, new_shift, stats, nonfinite
    launch(_transport_mask_fwd_kernel)[(nseg,)](
        scores,
        offsets,
        keep,
        eps,
        log_odds,
        shift,
        mask,
        new_log_odds,
        new_shift,
        stats,
        nonfinite,
        ACC=_acc(scores),
        BLOCK=BLOCK,
        NEUTRAL=neutral,
    )
    return mask, new_log_odds, new_shift, stats, nonfinite


def transport_mask_backward(
    launch, grad_mask, scores, offsets, keep, eps, log_odds, stats, neutral, segment_size=0
):
    nseg = offsets.shape[0] - 1
    grad_scores = torch.empty_like(scores)
    grad_keep = torch.empty_like(keep)
    if segment_size:
        segs = BLOCK // segment_size
        launch(_transport_mask_blocks_bwd_kernel)[(triton.cdiv(nseg, segs),)](
            grad_mask.contiguous(),
            scores,
            keep,
            eps,
            log_odds,
            stats,
            grad_scores,
            grad_keep,
            nseg,
            ACC=_acc(scores),
            M=segment_size,
            SEGS=segs,
            NEUTRAL=neutral,
        )
        return grad_scores, grad_keep
    launch(_transport_mask_bwd_kernel)[(nseg,)](
        grad_mask.contiguous(),
        scores,
        offsets,
        keep,
        eps,
        log_odds,
        stats,
        grad_scores,
        grad_keep,
        ACC=_acc(scores),
        BLOCK=BLOCK,
        NEUTRAL=neutral,
    )
    return grad_scores, grad_keep
