"""Triton kernels of the DTP transport-mask step, one Sinkhorn iteration (iters = 1).

Segments of any size, two schedules (chosen by `programs_per_segment`):
- fused: program p handles segment p in one launch forward and one backward: a first
  loop over BLOCK-sized chunks builds the per-chunk max and sum-exp of both columns and
  merges them in chunk order (online log-sum-exp), a second writes the mask and the next
  state;
- split, for large segments: P programs per segment each write the partial sums of their
  part of the segment, and a second launch merges them in a fixed order and writes.
Neither uses atomics, so results are bitwise reproducible. Segments all of one tiny size
(segment_size 4, 8 or 16, N:M blocks): a program takes a tile of them. The math follows
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


# ---- segments of any size ------------------------------------------------------------
#
# Each element loop is one function over a [lo, hi) range of a segment and each
# per-segment update one function of the merged sums, as in the CUDA kernels. The fused
# schedule runs them in sequence in one program per segment; the split schedule gives a
# segment PARTS programs, writes their partial sums to a workspace and merges them in a
# second launch (every program of a segment merges the same partials in the same order).


@triton.jit
def _x_range(scores_ptr, log_odds_ptr, idx, valid, inv_eps, ACC, NEUTRAL: tl.constexpr):
    """(x = d + (2 s - 1) / eps, the carried log-odds d, scores finite) at idx."""
    s, s_ok = _load_scores(scores_ptr, idx, valid, ACC, NEUTRAL)
    d = tl.load(log_odds_ptr + idx, mask=valid, other=0.0).to(ACC)
    return d + (2.0 * s - 1.0) * inv_eps, d, s_ok


@triton.jit
def _fwd_sums(scores_ptr, log_odds_ptr, lo, hi, inv_eps, delta, ACC, BLOCK: tl.constexpr, NEUTRAL):
    """Over [lo, hi): max and sum-exp of both columns' log-weights (BLOCK-chunk partials
    merged in chunk order, online log-sum-exp) and the count of non-finite s or x."""
    lanes = tl.arange(0, BLOCK)
    m1 = tl.full((), float("-inf"), ACC)
    s1 = tl.zeros((), ACC)
    m0 = tl.full((), float("-inf"), ACC)
    s0 = tl.zeros((), ACC)
    bad = tl.zeros((), tl.int32)
    for chunk in range(lo, hi, BLOCK):
        idx = chunk + lanes
        valid = idx < hi
        x, _d, s_ok = _x_range(scores_ptr, log_odds_ptr, idx, valid, inv_eps, ACC, NEUTRAL)
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
    return m1, s1, m0, s0, bad


@triton.jit
def _fwd_update(n, k, delta, lse1, lse0, bad):
    """The segment's next shift and what the step does: (new shift, non-finite, advance,
    degenerate). k = 0 or k = n has one feasible plan: mask k/n, state kept
    (docs/design.md; reference.py)."""
    degenerate = (k <= 0.0) | (k >= n)
    k_safe = tl.where(degenerate, n * 0.5, k)
    new_delta = tl.log(k_safe) - tl.log(n - k_safe) + delta - lse1 + lse0
    nonfinite = (bad != 0) | (new_delta - new_delta != 0.0)
    advance = ~nonfinite & ~degenerate
    return new_delta, nonfinite, advance, degenerate


@triton.jit
def _fwd_write(
    scores_ptr,
    log_odds_ptr,
    mask_ptr,
    new_log_odds_ptr,
    lo,
    hi,
    n,
    k,
    inv_eps,
    delta,
    lse1,
    new_delta,
    advance,
    degenerate,
    ACC,
    BLOCK: tl.constexpr,
    NEUTRAL,
):
    """Over [lo, hi): the mask k exp(log sigmoid(x + delta) - lse1) and the next log-odds."""
    lanes = tl.arange(0, BLOCK)
    for chunk in range(lo, hi, BLOCK):
        idx = chunk + lanes
        valid = idx < hi
        x, d, _ok = _x_range(scores_ptr, log_odds_ptr, idx, valid, inv_eps, ACC, NEUTRAL)
        mask = k * tl.exp(_log_sigmoid(x + delta) - lse1)
        mask = tl.where(degenerate, k / n, mask)
        tl.store(mask_ptr + idx, mask.to(mask_ptr.dtype.element_ty), mask=valid)
        new_d = tl.where(advance, x + new_delta, d)
        tl.store(new_log_odds_ptr + idx, new_d.to(new_log_odds_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _fwd_write_segment(
    new_shift_ptr, stats_ptr, nonfinite_ptr, seg, delta, lse1, lse0, new_delta, nonfinite, advance
):
    """The segment's next shift, its stats for the backward (delta, lse1, lse0), its flag."""
    new_shift = tl.where(advance, new_delta, delta)
    tl.store(new_shift_ptr + seg, new_shift.to(new_shift_ptr.dtype.element_ty))
    tl.store(stats_ptr + 3 * seg, delta.to(stats_ptr.dtype.element_ty))
    tl.store(stats_ptr + 3 * seg + 1, lse1.to(stats_ptr.dtype.element_ty))
    tl.store(stats_ptr + 3 * seg + 2, lse0.to(stats_ptr.dtype.element_ty))
    tl.store(nonfinite_ptr + seg, nonfinite)


@triton.jit
def _segment_scalars(offsets_ptr, keep_ptr, eps_ptr, keep_stride, eps_stride, seg, ACC):
    """(start, end, n, k, 1 / eps) of segment seg; keep and eps at stride 1 (one per
    segment) or 0 (one for all)."""
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    n = (end - start).to(ACC)
    k = tl.load(keep_ptr + seg * keep_stride).to(ACC)
    inv_eps = 1.0 / tl.load(eps_ptr + seg * eps_stride).to(ACC)
    return start, end, n, k, inv_eps


@triton.jit
def _part_range(start, end, part, parts, BLOCK: tl.constexpr):
    """[lo, hi) of program `part` of `parts` over [start, end): whole BLOCK chunks, the
    last programs of a short segment empty."""
    chunks = (end - start + BLOCK - 1) // BLOCK
    length = (chunks + parts - 1) // parts * BLOCK
    lo = tl.minimum(start + part * length, end)
    hi = tl.minimum(lo + length, end)
    return lo, hi


@triton.jit
def _transport_mask_fwd_kernel(
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    keep_stride,
    eps_stride,
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
    """Fused: program p does every phase of segment p."""
    seg = tl.program_id(0)
    start, end, n, k, inv_eps = _segment_scalars(
        offsets_ptr, keep_ptr, eps_ptr, keep_stride, eps_stride, seg, ACC
    )
    delta = tl.load(shift_ptr + seg).to(ACC)
    m1, s1, m0, s0, bad = _fwd_sums(
        scores_ptr, log_odds_ptr, start, end, inv_eps, delta, ACC, BLOCK, NEUTRAL
    )
    lse1 = m1 + tl.log(s1)
    lse0 = m0 + tl.log(s0)
    new_delta, nonfinite, advance, degenerate = _fwd_update(n, k, delta, lse1, lse0, bad)
    _fwd_write(
        scores_ptr,
        log_odds_ptr,
        mask_ptr,
        new_log_odds_ptr,
        start,
        end,
        n,
        k,
        inv_eps,
        delta,
        lse1,
        new_delta,
        advance,
        degenerate,
        ACC,
        BLOCK,
        NEUTRAL,
    )
    _fwd_write_segment(
        new_shift_ptr,
        stats_ptr,
        nonfinite_ptr,
        seg,
        delta,
        lse1,
        lse0,
        new_delta,
        nonfinite,
        advance,
    )


@triton.jit
def _split_fwd_sums_kernel(
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    keep_stride,
    eps_stride,
    log_odds_ptr,
    shift_ptr,
    partials_ptr,
    bad_ptr,
    parts,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    """Split, launch 1: program (p, q) writes the sums of part q of segment p."""
    seg = tl.program_id(0)
    part = tl.program_id(1)
    start, end, _n, _k, inv_eps = _segment_scalars(
        offsets_ptr, keep_ptr, eps_ptr, keep_stride, eps_stride, seg, ACC
    )
    delta = tl.load(shift_ptr + seg).to(ACC)
    lo, hi = _part_range(start, end, part, parts, BLOCK)
    m1, s1, m0, s0, bad = _fwd_sums(
        scores_ptr, log_odds_ptr, lo, hi, inv_eps, delta, ACC, BLOCK, NEUTRAL
    )
    slot = partials_ptr + 4 * (seg * parts + part)
    tl.store(slot, m1)
    tl.store(slot + 1, s1)
    tl.store(slot + 2, m0)
    tl.store(slot + 3, s0)
    tl.store(bad_ptr + seg * parts + part, bad)


@triton.jit
def _merge_lse(partials_ptr, seg, parts, column, ACC, PARTS_P2: tl.constexpr):
    """log-sum-exp of one column from the segment's partial (max, sum-exp) pairs; an
    empty part (max -inf, sum 0) adds nothing, a NaN partial makes the result NaN."""
    q = tl.arange(0, PARTS_P2)
    live = q < parts
    slot = partials_ptr + 4 * (seg * parts + q) + 2 * column
    m = tl.load(slot, mask=live, other=float("-inf"))
    s = tl.load(slot + 1, mask=live, other=0.0)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(s == 0.0, 0.0, s * tl.exp(m - top)), axis=0)
    return (top + tl.log(total)).to(ACC)


@triton.jit
def _split_fwd_output_kernel(
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    keep_stride,
    eps_stride,
    log_odds_ptr,
    shift_ptr,
    partials_ptr,
    bad_ptr,
    mask_ptr,
    new_log_odds_ptr,
    new_shift_ptr,
    stats_ptr,
    nonfinite_ptr,
    parts,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
    PARTS_P2: tl.constexpr,
):
    """Split, launch 2: program (p, q) merges segment p's partials and writes part q;
    part 0 also writes the segment's next shift, stats and flag."""
    seg = tl.program_id(0)
    part = tl.program_id(1)
    start, end, n, k, inv_eps = _segment_scalars(
        offsets_ptr, keep_ptr, eps_ptr, keep_stride, eps_stride, seg, ACC
    )
    delta = tl.load(shift_ptr + seg).to(ACC)
    lse1 = _merge_lse(partials_ptr, seg, parts, 0, ACC, PARTS_P2)
    lse0 = _merge_lse(partials_ptr, seg, parts, 1, ACC, PARTS_P2)
    q = tl.arange(0, PARTS_P2)
    bad = tl.sum(tl.load(bad_ptr + seg * parts + q, mask=q < parts, other=0), axis=0)
    new_delta, nonfinite, advance, degenerate = _fwd_update(n, k, delta, lse1, lse0, bad)
    lo, hi = _part_range(start, end, part, parts, BLOCK)
    _fwd_write(
        scores_ptr,
        log_odds_ptr,
        mask_ptr,
        new_log_odds_ptr,
        lo,
        hi,
        n,
        k,
        inv_eps,
        delta,
        lse1,
        new_delta,
        advance,
        degenerate,
        ACC,
        BLOCK,
        NEUTRAL,
    )
    if part == 0:
        _fwd_write_segment(
            new_shift_ptr,
            stats_ptr,
            nonfinite_ptr,
            seg,
            delta,
            lse1,
            lse0,
            new_delta,
            nonfinite,
            advance,
        )


@triton.jit
def _bwd_sums(
    grad_mask_ptr,
    scores_ptr,
    log_odds_ptr,
    lo,
    hi,
    inv_eps,
    delta,
    lse1,
    ACC,
    BLOCK: tl.constexpr,
    NEUTRAL,
):
    """Over [lo, hi): sum_i g_i p_i (p = mask / k) and sum_i g_i, in chunk order."""
    lanes = tl.arange(0, BLOCK)
    gp = tl.zeros((), ACC)
    gs = tl.zeros((), ACC)
    for chunk in range(lo, hi, BLOCK):
        idx = chunk + lanes
        valid = idx < hi
        x, _d, _ok = _x_range(scores_ptr, log_odds_ptr, idx, valid, inv_eps, ACC, NEUTRAL)
        g = tl.load(grad_mask_ptr + idx, mask=valid, other=0.0).to(ACC)
        p = tl.exp(_log_sigmoid(x + delta) - lse1)
        gp += tl.sum(tl.where(valid, g * p, 0.0), axis=0)
        gs += tl.sum(g, axis=0)
    return gp, gs


@triton.jit
def _bwd_write(
    grad_mask_ptr,
    scores_ptr,
    log_odds_ptr,
    grad_scores_ptr,
    lo,
    hi,
    k,
    inv_eps,
    delta,
    lse1,
    gp,
    degenerate,
    ACC,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    """Over [lo, hi): d score_i = (2 / eps) k sigmoid(z) sigmoid(-z) / S1 (g_i - sum g p)."""
    lanes = tl.arange(0, BLOCK)
    scale = 2.0 * inv_eps * k
    for chunk in range(lo, hi, BLOCK):
        idx = chunk + lanes
        valid = idx < hi
        x, _d, s_ok = _x_range(scores_ptr, log_odds_ptr, idx, valid, inv_eps, ACC, NEUTRAL)
        g = tl.load(grad_mask_ptr + idx, mask=valid, other=0.0).to(ACC)
        z = x + delta
        q = tl.exp(_log_sigmoid(z) + _log_sigmoid(-z) - lse1)
        grad = tl.where(degenerate, 0.0, scale * q * (g - gp))  # 0 even where q is NaN
        if NEUTRAL:
            grad = tl.where(s_ok, grad, 0.0)  # a score read as 0.5 gets no gradient
        tl.store(grad_scores_ptr + idx, grad.to(grad_scores_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _transport_mask_bwd_kernel(
    grad_mask_ptr,
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    keep_stride,
    eps_stride,
    log_odds_ptr,
    stats_ptr,
    grad_scores_ptr,
    grad_keep_ptr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    """Fused: program p does both passes of segment p."""
    seg = tl.program_id(0)
    start, end, n, k, inv_eps = _segment_scalars(
        offsets_ptr, keep_ptr, eps_ptr, keep_stride, eps_stride, seg, ACC
    )
    delta = tl.load(stats_ptr + 3 * seg).to(ACC)
    lse1 = tl.load(stats_ptr + 3 * seg + 1).to(ACC)
    degenerate = (k <= 0.0) | (k >= n)
    gp, gs = _bwd_sums(
        grad_mask_ptr,
        scores_ptr,
        log_odds_ptr,
        start,
        end,
        inv_eps,
        delta,
        lse1,
        ACC,
        BLOCK,
        NEUTRAL,
    )
    _bwd_write(
        grad_mask_ptr,
        scores_ptr,
        log_odds_ptr,
        grad_scores_ptr,
        start,
        end,
        k,
        inv_eps,
        delta,
        lse1,
        gp,
        degenerate,
        ACC,
        BLOCK,
        NEUTRAL,
    )
    grad_keep = tl.where(degenerate, gs / n, gp)
    tl.store(grad_keep_ptr + seg, grad_keep.to(grad_keep_ptr.dtype.element_ty))


@triton.jit
def _split_bwd_sums_kernel(
    grad_mask_ptr,
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    keep_stride,
    eps_stride,
    log_odds_ptr,
    stats_ptr,
    partials_ptr,
    parts,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
):
    """Split, launch 1: program (p, q) writes sum g p and sum g over part q of segment p."""
    seg = tl.program_id(0)
    part = tl.program_id(1)
    start, end, _n, _k, inv_eps = _segment_scalars(
        offsets_ptr, keep_ptr, eps_ptr, keep_stride, eps_stride, seg, ACC
    )
    delta = tl.load(stats_ptr + 3 * seg).to(ACC)
    lse1 = tl.load(stats_ptr + 3 * seg + 1).to(ACC)
    lo, hi = _part_range(start, end, part, parts, BLOCK)
    gp, gs = _bwd_sums(
        grad_mask_ptr, scores_ptr, log_odds_ptr, lo, hi, inv_eps, delta, lse1, ACC, BLOCK, NEUTRAL
    )
    slot = partials_ptr + 2 * (seg * parts + part)
    tl.store(slot, gp)
    tl.store(slot + 1, gs)


@triton.jit
def _split_bwd_output_kernel(
    grad_mask_ptr,
    scores_ptr,
    offsets_ptr,
    keep_ptr,
    eps_ptr,
    keep_stride,
    eps_stride,
    log_odds_ptr,
    stats_ptr,
    partials_ptr,
    grad_scores_ptr,
    grad_keep_ptr,
    parts,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    NEUTRAL: tl.constexpr,
    PARTS_P2: tl.constexpr,
):
    """Split, launch 2: program (p, q) sums segment p's partials in part order and writes
    the score gradient of part q; part 0 also writes the keep gradient."""
    seg = tl.program_id(0)
    part = tl.program_id(1)
    start, end, n, k, inv_eps = _segment_scalars(
        offsets_ptr, keep_ptr, eps_ptr, keep_stride, eps_stride, seg, ACC
    )
    delta = tl.load(stats_ptr + 3 * seg).to(ACC)
    lse1 = tl.load(stats_ptr + 3 * seg + 1).to(ACC)
    degenerate = (k <= 0.0) | (k >= n)
    q = tl.arange(0, PARTS_P2)
    slot = partials_ptr + 2 * (seg * parts + q)
    gp = tl.sum(tl.load(slot, mask=q < parts, other=0.0), axis=0).to(ACC)
    gs = tl.sum(tl.load(slot + 1, mask=q < parts, other=0.0), axis=0).to(ACC)
    lo, hi = _part_range(start, end, part, parts, BLOCK)
    _bwd_write(
        grad_mask_ptr,
        scores_ptr,
        log_odds_ptr,
        grad_scores_ptr,
        lo,
        hi,
        k,
        inv_eps,
        delta,
        lse1,
        gp,
        degenerate,
        ACC,
        BLOCK,
        NEUTRAL,
    )
    if part == 0:
        grad_keep = tl.where(degenerate, gs / n, gp)
        tl.store(grad_keep_ptr + seg, grad_keep.to(grad_keep_ptr.dtype.element_ty))


# ---- segments all of one tiny size M (4, 8, 16; the blocks of N:M sparsity) ----------
#
# Program p handles BLOCK // M consecutive segments as a [segments, M] tile: no offsets
# are read, every sum is a row reduction of the tile, each row in a fixed order.


@triton.jit
def _tile_values(keep_ptr, keep_stride, eps_ptr, eps_stride, seg, nseg, ACC):
    """The tile's k and 1 / eps: keep and eps at stride 1 (one per segment) or 0 (one for
    all: every lane reads the same address)."""
    k = tl.load(keep_ptr + seg * keep_stride, mask=seg < nseg, other=1.0).to(ACC)
    inv_eps = 1.0 / tl.load(eps_ptr + seg * eps_stride, mask=seg < nseg, other=1.0).to(ACC)
    return k, inv_eps


@triton.jit
def _blocks_tile(scores_ptr, log_odds_ptr, seg, inv_eps, nseg, ACC, M, NEUTRAL: tl.constexpr):
    """The tile's (index, valid, scores finite, log-odds, x) for its segments `seg`."""
    idx = seg[:, None] * M + tl.arange(0, M)[None, :]
    valid = (seg < nseg)[:, None] & (idx >= 0)  # (idx >= 0: the tile's shape, always true)
    s, s_ok = _load_scores(scores_ptr, idx, valid, ACC, NEUTRAL)
    d = tl.load(log_odds_ptr + idx, mask=valid, other=0.0).to(ACC)
    x = d + (2.0 * s - 1.0) * inv_eps[:, None]
    return idx, valid, s_ok, d, x


@triton.jit
def _transport_mask_blocks_fwd_kernel(
    scores_ptr,
    keep_ptr,
    eps_ptr,
    keep_stride,
    eps_stride,
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
    seg = tl.program_id(0) * SEGS + tl.arange(0, SEGS)
    k, inv_eps = _tile_values(keep_ptr, keep_stride, eps_ptr, eps_stride, seg, nseg, ACC)
    idx, valid, s_ok, d, x = _blocks_tile(
        scores_ptr, log_odds_ptr, seg, inv_eps, nseg, ACC, M, NEUTRAL
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
    keep_stride,
    eps_stride,
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
    seg = tl.program_id(0) * SEGS + tl.arange(0, SEGS)
    k, inv_eps = _tile_values(keep_ptr, keep_stride, eps_ptr, eps_stride, seg, nseg, ACC)
    idx, valid, s_ok, _d, x = _blocks_tile(
        scores_ptr, log_odds_ptr, seg, inv_eps, nseg, ACC, M, NEUTRAL
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


def _strides(keep: torch.Tensor, eps: torch.Tensor) -> tuple[int, int]:
    """keep's and eps's strides as the kernels read them: 1 (one value per segment), or 0
    where an expand()ed view holds one value for all segments (the kernels then read that
    one address); any other layout is made contiguous by the caller."""
    keep_stride, eps_stride = (
        0 if t.dim() == 1 and t.numel() > 1 and t.stride(0) == 0 else 1 for t in (keep, eps)
    )
    return keep_stride, eps_stride


def _acc(scores: torch.Tensor):
    return tl.float64 if scores.dtype == torch.float64 else tl.float32


# The split schedule: from SPLIT_FROM elements, about PER_PROGRAM elements a program, at
# most MAX_PARTS programs a segment (each program reads all of its segment's partials).
SPLIT_FROM = 1 << 16
PER_PROGRAM = 1 << 14
MAX_PARTS = 1024


def programs_per_segment(numel: int, nseg: int, requested: int, device: torch.device) -> int:
    """Programs per segment: `requested` when > 0; else 1 (fused) below SPLIT_FROM
    elements or off the GPU (the interpreter), and above it one per PER_PROGRAM elements
    of the mean segment, at most MAX_PARTS. Decided from sizes known on the host (reading
    the offsets would cost a device-to-host sync)."""
    if requested > 0:
        return requested
    if device.type != "cuda" or numel < SPLIT_FROM:
        return 1
    return max(1, min(MAX_PARTS, triton.cdiv(numel, nseg * PER_PROGRAM)))


def transport_mask_forward(
    launch,
    scores,
    offsets,
    keep,
    eps,
    log_odds,
    shift,
    neutral,
    segment_size=0,
    blocks_per_segment=0,
    state_outputs=None,
):
    """Allocate outputs and launch the forward; `launch` wraps the kernel (wrap_triton, or
    the kernel itself in the eager step). segment_size 4, 8 or 16: every segment has that
    size, the tile kernel runs (unless blocks_per_segment > 0 forces a general schedule: 1
    fused, B > 1 split over B). `state_outputs`: the (log-odds, shift, flags) buffers to
    write the next state into (the eager step's pending buffers, of the state's dtype and
    sizes, none an input), else new ones."""
    nseg = offsets.shape[0] - 1
    mask = torch.empty_like(scores)
    if state_outputs is None:
        state_outputs = (
            torch.empty_like(log_odds),
            torch.empty_like(shift),
            torch.empty((nseg,), dtype=torch.bool, device=scores.device),
        )
    new_log_odds, new_shift, nonfinite = state_outputs
    stats = torch.empty((nseg, 1, 3), dtype=log_odds.dtype, device=scores.device)
    outputs = (mask, new_log_odds, new_shift, stats, nonfinite)
    if segment_size and not blocks_per_segment:
        segs = BLOCK // segment_size
        launch(_transport_mask_blocks_fwd_kernel)[(triton.cdiv(nseg, segs),)](
            scores,
            keep,
            eps,
            *_strides(keep, eps),
            log_odds,
            shift,
            *outputs,
            nseg,
            ACC=_acc(scores),
            M=segment_size,
            SEGS=segs,
            NEUTRAL=neutral,
        )
        return outputs
    parts = programs_per_segment(scores.numel(), nseg, blocks_per_segment, scores.device)
    if parts == 1:
        launch(_transport_mask_fwd_kernel)[(nseg,)](
            scores,
            offsets,
            keep,
            eps,
            *_strides(keep, eps),
            log_odds,
            shift,
            *outputs,
            ACC=_acc(scores),
            BLOCK=BLOCK,
            NEUTRAL=neutral,
        )
        return outputs
    partials = torch.empty((nseg, parts, 4), dtype=log_odds.dtype, device=scores.device)
    bad = torch.empty((nseg, parts), dtype=torch.int32, device=scores.device)
    inputs = (scores, offsets, keep, eps, *_strides(keep, eps), log_odds, shift, partials, bad)
    launch(_split_fwd_sums_kernel)[(nseg, parts)](
        *inputs, parts, ACC=_acc(scores), BLOCK=BLOCK, NEUTRAL=neutral
    )
    launch(_split_fwd_output_kernel)[(nseg, parts)](
        *inputs,
        *outputs,
        parts,
        ACC=_acc(scores),
        BLOCK=BLOCK,
        NEUTRAL=neutral,
        PARTS_P2=triton.next_power_of_2(parts),
    )
    return outputs


def transport_mask_backward(
    launch,
    grad_mask,
    scores,
    offsets,
    keep,
    eps,
    log_odds,
    stats,
    neutral,
    segment_size=0,
    blocks_per_segment=0,
):
    """The score and keep gradients; the schedule is chosen as the forward's."""
    nseg = offsets.shape[0] - 1
    grad_mask = grad_mask.contiguous()
    grad_scores = torch.empty_like(scores)
    grad_keep = torch.empty_like(keep)
    if segment_size and not blocks_per_segment:
        segs = BLOCK // segment_size
        launch(_transport_mask_blocks_bwd_kernel)[(triton.cdiv(nseg, segs),)](
            grad_mask,
            scores,
            keep,
            eps,
            *_strides(keep, eps),
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
    inputs = (grad_mask, scores, offsets, keep, eps, *_strides(keep, eps), log_odds, stats)
    parts = programs_per_segment(scores.numel(), nseg, blocks_per_segment, scores.device)
    if parts == 1:
        launch(_transport_mask_bwd_kernel)[(nseg,)](
            *inputs,
            grad_scores,
            grad_keep,
            ACC=_acc(scores),
            BLOCK=BLOCK,
            NEUTRAL=neutral,
        )
        return grad_scores, grad_keep
    partials = torch.empty((nseg, parts, 2), dtype=log_odds.dtype, device=scores.device)
    launch(_split_bwd_sums_kernel)[(nseg, parts)](
        *inputs, partials, parts, ACC=_acc(scores), BLOCK=BLOCK, NEUTRAL=neutral
    )
    launch(_split_bwd_output_kernel)[(nseg, parts)](
        *inputs,
        partials,
        grad_scores,
        grad_keep,
        parts,
        ACC=_acc(scores),
        BLOCK=BLOCK,
        NEUTRAL=neutral,
        PARTS_P2=triton.next_power_of_2(parts),
    )
    return grad_scores, grad_keep
