"""What DTP's mask does: sums to k, the paper's Fig. 2 toy, long runs, non-finite input."""

import copy

import pytest
import torch

from conftest import RAGGED_LAYOUT
from dtp_kernels import TransportState, transport_mask


def test_mask_sums_to_k(any_backend):
    sizes = [n for n, _ in RAGGED_LAYOUT]
    keep = torch.tensor([k for _, k in RAGGED_LAYOUT])
    state = TransportState(sizes)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        scores = torch.randn(sum(sizes), generator=gen) * 3
        mask = transport_mask(scores, keep, state, backend=any_backend)
        sums = torch.stack([m.double().sum() for m in mask.split(sizes)])
        torch.testing.assert_close(sums, keep.double(), rtol=1e-5, atol=1e-5)
        state.commit()


def test_list_of_segments_in_list_out(any_backend):
    sizes = [3, 5]
    parts = [torch.randn(3), torch.randn(5)]
    masks = transport_mask(parts, [1, 2], TransportState(sizes), backend=any_backend)
    flat = transport_mask(torch.cat(parts), [1, 2], TransportState(sizes), backend=any_backend)
    assert isinstance(masks, list) and [m.numel() for m in masks] == sizes
    assert torch.equal(torch.cat(masks), flat)


def test_non_contiguous_scores(fast_backend):
    base = torch.randn(2 * 40, generator=torch.Generator().manual_seed(4))
    strided = base[::2]
    assert not strided.is_contiguous()
    sizes = [15, 25]
    got = transport_mask(strided, [3, 7.5], TransportState(sizes), backend=fast_backend)
    want = transport_mask(
        strided.contiguous(), [3, 7.5], TransportState(sizes), backend=fast_backend
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("iters", [1, 5])
def test_fig2_toy_converges(any_backend, iters):
    """Paper Fig. 2: w = [2, 1, 3], keep 1 of 3, loss w . mask: the mask picks weight 2
    (the toy `python -m dtp_kernels.demo --toy` prints)."""
    from dtp_kernels.demo import fig2_toy

    _step, mask, loss, _scores = fig2_toy(steps=300, iters=iters, backend=any_backend)[-1]
    torch.testing.assert_close(torch.tensor(mask), torch.tensor([0.0, 1.0, 0.0]), atol=1e-3, rtol=0)
    assert abs(loss - 1.0) < 1e-3


@pytest.mark.parametrize("backend,steps", [("cpu", 100_000), ("torch", 10_000)])
@pytest.mark.slow
def test_fp32_stays_finite_for_long_runs(backend, steps):
    """Scores up to |s| = 1e3 for 1e5 steps: the fp32 state and masks stay finite."""
    from conftest import FAST_CPU_BACKENDS

    if backend not in FAST_CPU_BACKENDS:
        pytest.skip(f"backend {backend} is not built here")
    sizes = [1, 2, 7, 64]
    keep = torch.tensor([1.0, 1.0, 3.5, 16.0])
    state = TransportState(sizes)
    gen = torch.Generator().manual_seed(5)
    scores = (torch.rand(sum(sizes), generator=gen) * 2 - 1) * 1e3
    scores[:3] = torch.tensor([1e3, -1e3, 1e3])
    for step in range(steps):
        if step % 1000 == 0:  # new extreme scores now and then, fixed in between
            scores = (torch.rand(sum(sizes), generator=gen) * 2 - 1) * 1e3
        mask = transport_mask(scores, keep, state, backend=backend)
        state.commit()
    assert torch.isfinite(state.log_odds).all() and torch.isfinite(state.shift).all()
    assert torch.isfinite(mask).all()
    sums = torch.stack([m.double().sum() for m in mask.split(sizes)])
    torch.testing.assert_close(sums, keep.double(), rtol=1e-4, atol=1e-4)
    assert int(state.steps) == steps


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_segment_keeps_its_state(any_backend, bad_value):
    sizes = [4, 6, 5]
    keep = [2.0, 3.0, 1.5]
    state = TransportState(sizes)
    scores = torch.randn(15, generator=torch.Generator().manual_seed(6))
    transport_mask(scores, keep, state, backend=any_backend)
    state.commit()
    before_d, before_shift = state.log_odds.clone(), state.shift.clone()
    poisoned = scores.clone()
    poisoned[5] = bad_value  # segment 1
    mask = transport_mask(poisoned, keep, state, backend=any_backend)
    state.commit()
    if bad_value != bad_value:  # NaN propagates (default "propagate"), into its segment only
        assert torch.isnan(mask[4:10]).all()
    assert torch.isfinite(mask[:4]).all() and torch.isfinite(mask[10:]).all()
    assert state.skipped_steps.tolist() == [0, 1, 0] and int(state.steps) == 2
    assert torch.equal(state.log_odds[4:10], before_d[4:10])
    assert state.shift[1] == before_shift[1]
    assert not torch.equal(state.log_odds[:4], before_d[:4])  # the others advance
    assert not torch.equal(state.log_odds[10:], before_d[10:])
    assert state.shift[0] != before_shift[0] and state.shift[2] != before_shift[2]
    # finite again: the segment trains on from where it stood
    mask = transport_mask(scores, keep, state, backend=any_backend)
    state.commit()
    assert torch.isfinite(mask).all() and not torch.equal(state.log_odds[4:10], before_d[4:10])


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_neutral_nonfinite_reads_bad_scores_as_half(any_backend, bad_value):
    """nonfinite="neutral": the mask and gradients of the scores with the bad entry set to
    0.5 (the reference), no gradient for that entry, and its segment held and flagged."""
    sizes, keep = [4, 6, 5], [2.0, 3.0, 1.5]
    gen = torch.Generator().manual_seed(8)
    scores = torch.randn(15, generator=gen, dtype=torch.float64)
    weights = torch.randn(15, generator=gen, dtype=torch.float64)
    state = TransportState(sizes, dtype=torch.float64)
    transport_mask(scores, keep, state, backend=any_backend)
    state.commit()
    ref_state = copy.deepcopy(state)
    poisoned = scores.clone()
    poisoned[5] = bad_value  # segment 1
    s = poisoned.clone().requires_grad_(True)
    mask = transport_mask(s, keep, state, backend=any_backend, nonfinite="neutral")
    (weights * mask).sum().backward()
    substituted = poisoned.clone()
    substituted[5] = 0.5
    s_ref = substituted.clone().requires_grad_(True)
    want = transport_mask(s_ref, keep, ref_state, backend="reference")
    (weights * want).sum().backward()
    torch.testing.assert_close(mask, want, rtol=1e-9, atol=1e-12)
    grad_want = s_ref.grad.clone()
    grad_want[5] = 0.0
    torch.testing.assert_close(s.grad, grad_want, rtol=1e-9, atol=1e-12)
    assert s.grad[5] == 0
    held = state.log_odds.clone(), state.shift.clone()
    state.commit()
    ref_state.commit()
    assert torch.equal(state.log_odds[4:10], held[0][4:10]) and state.shift[1] == held[1][1]
    torch.testing.assert_close(state.log_odds[:4], ref_state.log_odds[:4])
    torch.testing.assert_close(state.log_odds[10:], ref_state.log_odds[10:])
    assert state.skipped_steps.tolist() == [0, 1, 0]


@pytest.mark.parametrize("bad_first", [True, False])
def test_last_forward_before_a_commit_decides_the_hold(fast_backend, bad_first):
    """Two forwards before one commit (gradient accumulation): the state and the skipped
    count both come from the last one."""
    sizes, keep = [4, 6, 5], [2.0, 3.0, 1.5]
    scores = torch.randn(15, generator=torch.Generator().manual_seed(10))
    poisoned = scores.clone()
    poisoned[5] = float("nan")
    state = TransportState(sizes)
    for s in (poisoned, scores) if bad_first else (scores, poisoned):
        transport_mask(s, keep, state, backend=fast_backend, nonfinite="neutral")
    state.commit()
    assert state.skipped_steps.tolist() == ([0, 0, 0] if bad_first else [0, 1, 0])
    assert torch.equal(state.log_odds[4:10], torch.zeros(6)) != bad_first


def test_neutral_nonfinite_gradcheck(fast_backend):
    """float64 gradcheck through the neutral mode with a NaN and an Inf score."""
    sizes, keep = [4, 6, 5], [2.0, 3.0, 1.5]
    gen = torch.Generator().manual_seed(9)
    state = TransportState(sizes, dtype=torch.float64)
    state.log_odds.copy_(torch.randn(15, generator=gen, dtype=torch.float64))
    scores = torch.randn(15, generator=gen, dtype=torch.float64)
    scores[1], scores[12] = float("nan"), float("inf")
    scores.requires_grad_(True)

    def f(s):
        return transport_mask(
            s, keep, state, backend=fast_backend, update=False, nonfinite="neutral"
        )

    assert torch.isfinite(f(scores)).all()
    assert torch.autograd.gradcheck(f, (scores,), eps=1e-6, atol=1e-6)


def test_overflowing_log_odds_hold_and_flag_the_segment(fast_backend):
    """Finite scores whose log-odds overflow fp32 (s / eps > 3.4e38) hold their segment
    and count a skipped step in both modes (the float64 reference does not overflow)."""
    sizes, keep = [3, 4], [1.0, 2.0]
    for mode in ("propagate", "neutral"):
        state = TransportState(sizes)
        scores = torch.tensor([0.1, 0.9, 0.3, 0.2, 3e38, 0.4, 0.8])
        transport_mask(scores, keep, state, eps=0.1, backend=fast_backend, nonfinite=mode)
        state.commit()
        assert state.skipped_steps.tolist() == [0, 1], mode
        assert torch.equal(state.log_odds[3:], torch.zeros(4))
        assert not torch.equal(state.log_odds[:3], torch.zeros(3))


def test_autocast_returns_scores_dtype(any_backend):
    """Under autocast the op keeps the scores' dtype and agrees with the fp32 reference."""
    sizes = [5, 17]
    scores = torch.rand(22, generator=torch.Generator().manual_seed(7))
    want = transport_mask(scores.double(), [2.0, 8.5], TransportState(sizes), backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got32 = transport_mask(scores, [2.0, 8.5], TransportState(sizes), backend=any_backend)
        got16 = transport_mask(
            scores.bfloat16(), [2.0, 8.5], TransportState(sizes), backend=any_backend
        )
    assert got32.dtype == torch.float32 and got16.dtype == torch.bfloat16
    torch.testing.assert_close(got32.double(), want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got16.double(), want, rtol=2e-2, atol=1e-2)
