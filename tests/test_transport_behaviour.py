"""What DTP's mask does: sums to k, the paper's Fig. 2 toy, long runs, non-finite input."""

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
    transport_mask(poisoned, keep, state, backend=any_backend)
    state.commit()
    assert torch.equal(state.log_odds[4:10], before_d[4:10])
    assert state.shift[1] == before_shift[1]
    assert not torch.equal(state.log_odds[:4], before_d[:4])  # the others advance
    assert not torch.equal(state.log_odds[10:], before_d[10:])
    assert state.shift[0] != before_shift[0] and state.shift[2] != before_shift[2]
    # finite again: the segment trains on from where it stood
    mask = transport_mask(scores, keep, state, backend=any_backend)
    state.commit()
    assert torch.isfinite(mask).all() and not torch.equal(state.log_odds[4:10], before_d[4:10])


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
