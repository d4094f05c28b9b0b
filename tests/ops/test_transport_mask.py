"""transport_mask, the DTP mask step: every backend against the literal reference.

- Values and gradients: every backend equals the literal reference over a training loop.
- What DTP's mask does: sums to k, the paper's Fig. 2 toy, long runs, non-finite input.
- Bad input: a clear error naming the argument, the segment and the allowed range, and
the state untouched.
"""

import copy

import pytest
import torch

from dtp_kernels import TransportState, transport_mask
from utils import (
    ALL_CPU_BACKENDS,
    CUDA,
    FAST_CPU_BACKENDS,
    RAGGED_LAYOUT,
    check_fixed_scores_against_reference,
    check_low_precision,
    cuda_backends,
    require_backend,
    run_loop,
)

# -- values and gradients against the reference --------------------------------------


@pytest.mark.parametrize("iters", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_200_steps_match_reference(device_backend, dtype, iters):
    device, backend = device_backend
    # The Triton interpreter costs ~2 ms per program instance: 10 steps keep CI short (the
    # compiled backends run all 200, and the same kernels run 200 on CUDA).
    steps = 10 if (device, backend) == ("cpu", "triton") else 200
    state, ref_state = run_loop(backend, dtype, iters, steps=steps, device=device)
    assert int(state.steps) == int(ref_state.steps) == steps


# Segments longer than one 4,096-element chunk of the C++ kernels, 40,964 elements in all
# (above the 32,768 at which they split the work over threads): each segment's chunk
# partials must be merged, not overwritten, in forward and backward.
MULTI_CHUNK_LAYOUT = [(4097, 1000.0), (8193, 4000.5), (12289, 6144.0), (16385, 1.0)]


@pytest.mark.parametrize("iters", [1, 3])
def test_segments_over_one_chunk_match_reference(fast_backend, iters):
    state, _ = run_loop(fast_backend, torch.float64, iters, steps=3, layout=MULTI_CHUNK_LAYOUT)
    assert int(state.steps) == 3


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_reference_backend_is_deterministic_oracle(backend):
    """The loop itself is meaningful: masks move away from the uniform start."""
    sizes = [5, 7]
    state = TransportState(sizes, dtype=torch.float64)
    scores = torch.linspace(-1, 2, 12, dtype=torch.float64)
    first = transport_mask(scores, [2.0, 3.0], state, backend=backend)
    for _ in range(20):
        transport_mask(scores, [2.0, 3.0], state, backend=backend)
        state.commit()
    later = transport_mask(scores, [2.0, 3.0], state, backend=backend)
    assert (later - first).abs().max() > 0.1


@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_gradcheck_float64(backend, iters):
    # Interior k only: finite differences in k must stay inside [0, n] (see the
    # degenerate test below for k = 0 and k = n).
    layout = [(1, 0.5), (2, 0.5), (3, 1.0), (6, 2.5), (5, 4.0), (4, 0.25)]
    sizes = [n for n, _ in layout]
    state = TransportState(sizes, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(sum(sizes), generator=gen, dtype=torch.float64)
    # Move the state off the uniform start so every term of the formula is exercised.
    for _ in range(3):
        transport_mask(scores * 3, [k for _, k in layout], state, eps=0.5, backend="reference")
        state.commit()
    keep = torch.tensor([k for _, k in layout], dtype=torch.float64, requires_grad=True)
    scores.requires_grad_(True)

    def fn(s, k):
        return transport_mask(s, k, state, eps=0.5, iters=iters, update=False, backend=backend)

    assert torch.autograd.gradcheck(fn, (scores, keep), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_scores_match_reference(device_backend, dtype):
    device, backend = device_backend
    check_low_precision(backend, dtype, device=device)


def test_fast_backends_agree_with_each_other():
    if len(FAST_CPU_BACKENDS) < 2:
        pytest.skip("only one fast backend is built here")
    sizes = [n for n, _ in RAGGED_LAYOUT]
    keep = [k for _, k in RAGGED_LAYOUT]
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(3))
    masks = [
        transport_mask(scores, keep, TransportState(sizes), backend=b) for b in FAST_CPU_BACKENDS
    ]
    for other in masks[1:]:
        torch.testing.assert_close(other, masks[0], rtol=2e-5, atol=2e-6)


def test_degenerate_segments_have_constant_masks(any_backend):
    """k = 0 and k = n: mask k/n, no score gradient, d mask / d k = 1/n, state unmoved."""
    sizes = [4, 3, 5]
    state = TransportState(sizes, dtype=torch.float64)
    scores = torch.randn(12, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([0.0, 3.0, 2.0], dtype=torch.float64, requires_grad=True)
    weights = torch.arange(12, dtype=torch.float64)
    mask = transport_mask(scores, keep, state, backend=any_backend)
    (weights * mask).sum().backward()
    torch.testing.assert_close(mask[:7], torch.tensor([0.0] * 4 + [1.0] * 3, dtype=torch.float64))
    assert torch.all(scores.grad[:7] == 0) and torch.any(scores.grad[7:] != 0)
    torch.testing.assert_close(keep.grad[:2], torch.tensor([6 / 4, 15 / 3], dtype=torch.float64))
    state.commit()
    assert torch.all(state.log_odds[:7] == 0) and torch.all(state.shift[:2] == 0)
    assert torch.any(state.log_odds[7:] != 0)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("layout", [[4, 4, 4], [3, 5, 4]], ids=["blocks", "ragged"])
def test_degenerate_segment_with_a_bad_score_has_zero_gradient(device_backend, bad_value, layout):
    """The mask of k = 0 or k = n is constant whatever the scores: a NaN or Inf among them
    gives no NaN gradient (the reference's), and the segment is still flagged."""
    device, backend = device_backend
    dtype = torch.float32 if backend == "triton" and device == "cuda" else torch.float64
    state = TransportState(layout, dtype=dtype, device=device)
    scores = torch.rand(12, dtype=dtype)
    scores[[1, 5]] = bad_value
    scores = scores.to(device).requires_grad_(True)
    keep = [0.0, float(layout[1]), 2.0]
    mask = transport_mask(scores, keep, state, backend=backend)
    mask.backward(torch.linspace(-1, 1, 12, dtype=dtype, device=device))
    grad = scores.grad.cpu()
    assert torch.all(grad[:8] == 0) and torch.isfinite(grad[8:]).all()
    assert state.pending_nonfinite.tolist() == [True, True, False]
    ref = TransportState(layout, dtype=torch.float64)
    transport_mask(scores.detach().cpu().double(), keep, ref, backend="reference")
    assert ref.pending_nonfinite.tolist() == [True, True, False]


# The backends with an eager step entry of their own: one C++ call (cpu, cuda) or one
# autograd Function without the custom-op layer (triton).
EAGER_STEP_BACKENDS = [
    ("cpu", "cpu"),
    ("cpu", "triton"),
    pytest.param(("cuda", "cuda"), marks=pytest.mark.cuda),
    pytest.param(("cuda", "triton"), marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("device_and_backend", EAGER_STEP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("nonfinite", ["propagate", "neutral"])
def test_eager_step_entry_equals_the_op_and_write_pending(
    monkeypatch, device_and_backend, dtype, nonfinite
):
    """The eager training step (op + pending write) of the compiled backends is one C++
    call, of triton one autograd Function. It must give the mask, gradients and pending
    state of the functional op followed by write_pending, bitwise, a non-finite segment
    and float64 scores on a float32 state included; and it must be the path taken (the
    counter fails if the entry is bypassed)."""
    import importlib

    module = importlib.import_module("dtp_kernels.transport_mask")
    device, backend = device_and_backend
    require_backend(backend, device)
    sizes = [5, 9, 300]
    gen = torch.Generator().manual_seed(3)
    scores = (torch.randn(sum(sizes), generator=gen) * 2).to(device, dtype)
    scores[7] = float("nan")  # segment 1 keeps its state and is flagged
    keep = torch.tensor([2.0, 4.5, 120.0], device=device)
    grad = torch.randn(sum(sizes), generator=gen).to(device, dtype)
    calls = []
    name = "_triton_step" if backend == "triton" else "_compiled_step"
    entry = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(1) or entry(*args))
    functional = (
        module._transport_mask_triton if backend == "triton" else module._transport_mask_compiled
    )
    results = []
    for eager_entry in (True, False):
        state = TransportState(sizes, device=device)
        leaf = scores.clone().requires_grad_(True)
        keep_leaf = keep.clone().requires_grad_(True)
        if eager_entry:
            mask = transport_mask(leaf, keep_leaf, state, backend=backend, nonfinite=nonfinite)
        else:
            mask, new_d, new_shift, flags = functional(
                leaf,
                keep_leaf,
                torch.ones(3, dtype=torch.float64, device=device),
                state,
                1,
                nonfinite == "neutral",
            )
            state.write_pending(new_d, new_shift, nonfinite=flags)
        versions = [state.pending_log_odds._version, state.has_pending._version]
        torch.nan_to_num(mask).backward(grad)
        state_now = {k: v.clone() for k, v in state.state_dict().items()}
        results.append((mask, leaf.grad, keep_leaf.grad, state_now, versions))
    assert calls == [1]
    (mask_a, grad_a, keep_a, state_a, ver_a), (mask_b, grad_b, keep_b, state_b, ver_b) = results
    assert ver_a == ver_b and min(ver_a) > 0  # marked as written in place, as by write_pending
    assert torch.equal(mask_a.nan_to_num(7.0), mask_b.nan_to_num(7.0))
    assert torch.equal(grad_a.nan_to_num(7.0), grad_b.nan_to_num(7.0))
    assert torch.equal(keep_a.nan_to_num(7.0), keep_b.nan_to_num(7.0))
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
    assert bool(state_a["has_pending"]) and state_a["pending_nonfinite"].tolist() == [
        False,
        True,
        False,
    ]


# A general layout and one of tiny equal segments (the N:M kernels), with a partial tile.
LENT_LAYOUTS = {"general": ([300, 5], [100.0, 2.0]), "tiny": ([4] * 37, [2.0] * 37)}


@pytest.mark.parametrize(
    "device,backend",
    [
        ("cpu", "cpu"),
        ("cpu", "triton"),
        pytest.param("cuda", "cuda", marks=pytest.mark.cuda),
        pytest.param("cuda", "triton", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("layout", sorted(LENT_LAYOUTS))
@pytest.mark.parametrize("scores_dtype", [torch.float32, torch.float64], ids=["lent", "copied"])
def test_step_writes_the_next_state_into_the_pending_buffers(scores_dtype, layout, device, backend):
    """The eager step lends TransportState's pending buffers to the kernels (CPU, CUDA or
    Triton), which write the next log-odds, shift and flags into them: no copies, and the
    same buffers (bumped versions). float64 scores on a float32 state cannot be lent: three
    copies. (Triton's CPU interpreter copies every tensor it reads: not counted.) The step
    counted is the second: the first makes the state's eps and sizes tensors, once (on a
    GPU, a host-to-device copy each)."""
    require_backend(backend, device)
    sizes, keep = LENT_LAYOUTS[layout]
    state = TransportState(sizes, device=device)
    assert state.segment_size == (4 if layout == "tiny" else 0)
    scores = torch.rand(sum(sizes), dtype=scores_dtype).to(device)
    keep = torch.tensor(keep, device=device)  # made here: a host-to-device copy is not the step's
    transport_mask(scores, keep, state, backend=backend)
    state.commit()
    buffers = [state.pending_log_odds, state.pending_shift, state.pending_nonfinite]
    versions = [b._version for b in buffers]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        transport_mask(scores, keep, state, backend=backend)
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")
    if (device, backend) == ("cpu", "triton"):
        pass
    elif scores_dtype == torch.float32:
        assert copies == 0
    else:  # the three state outputs at least (keep's conversion may add more)
        assert copies >= 3
    assert [state.pending_log_odds, state.pending_shift, state.pending_nonfinite] == buffers
    assert all(b._version > v for b, v in zip(buffers, versions, strict=True))
    ref = TransportState(sizes, dtype=torch.float64)
    for _ in range(2):  # the two steps above
        ref.commit()
        transport_mask(scores.double().cpu(), keep.cpu(), ref, backend="reference")
    torch.testing.assert_close(
        state.pending_log_odds.double().cpu(), ref.pending_log_odds, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        state.pending_shift.double().cpu(), ref.pending_shift, rtol=1e-5, atol=1e-6
    )
    assert state.pending_nonfinite.tolist() == ref.pending_nonfinite.tolist()


@pytest.mark.parametrize("layout", sorted(LENT_LAYOUTS))
def test_cpu_step_checks_keep_before_writing_the_lent_buffers(layout):
    """The C++ step entry, reached without the Python checks: a keep out of range in the
    last segment fails and leaves the pending buffers as they were."""
    require_backend("cpu", "cpu")
    from dtp_kernels import _C

    sizes, keep = LENT_LAYOUTS[layout]
    state = TransportState(sizes)
    transport_mask(torch.rand(sum(sizes)), keep, state, backend="cpu")  # a pending step
    before = {k: v.clone() for k, v in state.state_dict().items()}
    buffers = state._buffers
    bad_keep = torch.tensor([*keep[:-1], sizes[-1] + 1.0])
    with pytest.raises(RuntimeError, match=rf"keep\[{len(sizes) - 1}\] = {sizes[-1] + 1}"):
        _C.transport_mask_step(
            torch.rand(sum(sizes)),
            state.offsets,
            bad_keep,
            torch.ones(len(sizes), dtype=torch.float64),
            state.log_odds,
            state.shift,
            1,
            False,
            0,
            state.segment_size,
            buffers["pending_log_odds"],
            buffers["pending_shift"],
            buffers["pending_nonfinite"],
            buffers["has_pending"],
        )
    for key, value in state.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_compiled_backend_without_update_leaves_pending_state_alone():
    state = TransportState([4, 6])
    before = {k: v.clone() for k, v in state.state_dict().items()}
    transport_mask(torch.randn(10), [2, 3], state, backend="cpu", update=False)
    for key, value in state.state_dict().items():
        assert torch.equal(value, before[key]), key


# -- what the mask does --------------------------------------------------------------


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


@pytest.mark.parametrize("backend,steps", [("cpu", 100_000), ("torch", 2_000)])
@pytest.mark.slow
def test_fp32_stays_finite_for_long_runs(backend, steps):
    """Scores up to |s| = 1e3 for 1e5 steps: the fp32 state and masks stay finite."""

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


def far_below_layout() -> tuple[list[int], list[float], torch.Tensor]:
    """Segments whose z all lie near -100 (or +100): sigmoid underflows in float32, so
    one column's sums taken without a stabiliser would be 0 and the kernels must scale
    them; beside them a segment with one z near 0 and the rest far below (its unscaled
    sums stand), and a segment over one chunk. Sizes, keep, float64 scores."""
    sizes, keep = [40, 40, 9, 5000], [10.0, 3.5, 2.0, 1200.0]
    gen = torch.Generator().manual_seed(8)
    parts = [
        0.05 * torch.rand(40, generator=gen, dtype=torch.float64),  # x in [-100, -90]
        1.0 - 0.05 * torch.rand(40, generator=gen, dtype=torch.float64),  # x in [90, 100]
        torch.cat([torch.tensor([0.5], dtype=torch.float64), torch.zeros(8, dtype=torch.float64)]),
        0.05 * torch.rand(5000, generator=gen, dtype=torch.float64),
    ]
    return sizes, keep, torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segments_far_below_both_columns_match_reference(fast_backend, dtype):
    """The far-below layout against the float64 reference over several steps."""
    sizes, keep, scores = far_below_layout()
    state = check_fixed_scores_against_reference(fast_backend, sizes, keep, scores, 0.01, dtype)
    assert state.skipped_steps.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("blocks", [1, 3], ids=["fused", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.cuda
def test_cuda_segments_far_below_both_columns_match_reference(dtype, blocks):
    """CUDA, both schedules: one iteration takes unscaled sums in its first pass and
    scales again only the segments whose sums could not stand, in the same launch."""
    if "cuda" not in cuda_backends():
        pytest.skip("the CUDA kernels are not built")
    sizes, keep, scores = far_below_layout()
    state = check_fixed_scores_against_reference(
        "cuda", sizes, keep, scores, 0.01, dtype, device=CUDA, blocks_per_segment=blocks
    )
    assert state.skipped_steps.tolist() == [0, 0, 0, 0]


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


# -- the split schedules (several blocks or programs per segment), non-finite input on
# the GPU, reproducibility -----------------------------------------------------------


@pytest.mark.parametrize("blocks", [2, 7])
@pytest.mark.parametrize("iters", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.cuda
def test_split_schedule_matches_reference(blocks, dtype, iters):
    """CUDA's several-blocks-per-segment schedule, forced on the ragged layout."""
    if "cuda" not in cuda_backends():
        pytest.skip("the CUDA kernels are not built")
    run_loop("cuda", dtype, iters, steps=50, device=CUDA, blocks_per_segment=blocks)


# Segments of one to five 1,024-element chunks of the Triton kernels: split over 2 or 3
# programs, parts hold several chunks, one chunk or nothing; both degenerate k.
TRITON_SPLIT_LAYOUT = [
    (1, 1.0),
    (3, 1.5),
    (1025, 300.0),
    (3000, 1000.5),
    (5000, 0.0),
    (4097, 4097.0),
    (2049, 7.25),
]
TRITON_DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.slow),  # interpreted
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("dtype,blocks", [(torch.float64, 3), (torch.float32, 2)])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_split_schedule_matches_reference(device, dtype, blocks):
    """Triton's several-programs-per-segment schedule, forced: values, score and keep
    gradients and the carried state against the reference over a training loop."""
    require_backend("triton", device)
    steps = 6 if device == "cpu" else 50  # interpreted on CPU: ~2 ms per program
    run_loop(
        "triton",
        dtype,
        1,
        steps=steps,
        layout=TRITON_SPLIT_LAYOUT,
        device=device,
        blocks_per_segment=blocks,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_split_schedule_low_precision(device, dtype):
    require_backend("triton", device)
    check_low_precision("triton", dtype, device, TRITON_SPLIT_LAYOUT, blocks_per_segment=3)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_split_schedule_gradcheck(device):
    """float64 gradcheck of the split kernels, the second part of each segment empty."""
    require_backend("triton", device)
    layout = [(2, 0.5), (5, 4.0), (6, 2.5)]
    sizes = [n for n, _ in layout]
    state = TransportState(sizes, dtype=torch.float64, device=device)
    scores = torch.rand(sum(sizes), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for _ in range(3):  # off the uniform start
        transport_mask(scores.to(device) * 3, [k for _, k in layout], state, eps=0.5)
        state.commit()
    keep = torch.tensor([k for _, k in layout], dtype=torch.float64, device=device)
    inputs = (scores.to(device).requires_grad_(True), keep.requires_grad_(True))

    def fn(s, k):
        return transport_mask(
            s, k, state, eps=0.5, update=False, backend="triton", blocks_per_segment=2
        )

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_triton_programs_per_segment_by_size():
    """Fused below 65,536 elements and off the GPU; above, one program per 16,384 elements
    of the mean segment, at most 1,024; a forced count always wins."""
    pytest.importorskip("triton")
    from dtp_kernels.kernels.transport_mask_triton import programs_per_segment

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert programs_per_segment(65_535, 1, 0, gpu) == 1
    assert programs_per_segment(10_000_000, 1, 0, cpu) == 1
    assert programs_per_segment(10_000_000, 1, 0, gpu) == 611
    assert programs_per_segment(100_000_000, 1, 0, gpu) == 1024
    assert programs_per_segment(25_000_000, 54, 0, gpu) == 29
    assert programs_per_segment(1_000_000, 1000, 0, gpu) == 1
    assert programs_per_segment(100, 3, 5, cpu) == 5


@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.cuda
def test_large_segments_take_split_schedule_and_match(iters):
    """Above 65536 elements CUDA splits segments; it agrees with the fused schedule, also
    split over 70 blocks (a merge warp's lanes then fold two or three partials each)."""
    if "cuda" not in cuda_backends():
        pytest.skip("the CUDA kernels are not built")
    sizes, keep = [300_000, 3, 90_001, 1], [1000.5, 1.5, 45_000.0, 1.0]
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(2)).to(CUDA)
    weights = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(3)).to(CUDA)
    out = {}
    for blocks in (0, 1, 70):  # 0 = the size-based choice (split here), 1 = fused
        s = scores.clone().requires_grad_(True)
        k = torch.tensor(keep, device=CUDA, requires_grad=True)
        state = TransportState(sizes, device=CUDA)
        mask = transport_mask(s, k, state, iters=iters, backend="cuda", blocks_per_segment=blocks)
        (weights * mask).sum().backward()
        out[blocks] = (mask.detach(), s.grad, k.grad, state.pending_log_odds, state.pending_shift)
    ref_state = TransportState(sizes, dtype=torch.float64)
    s = scores.double().cpu().requires_grad_(True)
    mask = transport_mask(s, keep, ref_state, iters=iters, backend="reference")
    for split in (0, 70):
        for a, b in zip(out[split], out[1], strict=True):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(out[0][0].double().cpu(), mask.detach(), rtol=2e-5, atol=1e-6)
    assert torch.allclose(out[0][0].sum(0).double().cpu(), torch.tensor(sum(keep)).double())


@pytest.mark.parametrize("blocks", [0, 3], ids=["fused", "split"])
@pytest.mark.parametrize("keep_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.cuda
def test_cuda_kernels_read_keep_in_its_own_dtype(keep_dtype, blocks):
    """The CUDA kernels read a float32 or float64 keep as given and write its gradient in
    that dtype (other dtypes go through float64): the mask and both gradients equal the
    reference's for each, in both schedules."""
    if "cuda" not in cuda_backends():
        pytest.skip("the CUDA kernels are not built")
    layout = [(7, 2.5), (300, 120.0), (1, 1.0), (40, 0.0)]
    sizes, kept = [n for n, _ in layout], [k for _, k in layout]
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(5)) * 2
    weights = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(6))
    results = {}
    for device, backend, dtype in (("cpu", "reference", torch.float64), (CUDA, "cuda", None)):
        s = scores.to(device, dtype or torch.float32).requires_grad_(True)
        k = torch.tensor(kept, dtype=dtype or keep_dtype, device=device, requires_grad=True)
        state = TransportState(sizes, dtype=dtype or torch.float32, device=device)
        options = {"blocks_per_segment": blocks} if backend == "cuda" else {}
        mask = transport_mask(s, k, state, backend=backend, **options)
        (weights.to(device, mask.dtype) * mask).sum().backward()
        assert k.grad.dtype == k.dtype
        results[backend] = [t.detach().double().cpu() for t in (mask, s.grad, k.grad)]
    # a bfloat16 keep's gradient is the float64 one rounded to bfloat16 (8 bits)
    keep_rtol = 2**-8 if keep_dtype == torch.bfloat16 else 2e-5
    for name, got, want, rtol in zip(
        ("mask", "scores' grad", "keep's grad"),
        results["cuda"],
        results["reference"],
        (2e-5, 2e-5, keep_rtol),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-5, msg=name)


# (device, backend, blocks per segment): 0 = the backend's own choice (fused at this
# size), 3 = split; Triton on CPU runs interpreted
SCHEDULES = [
    pytest.param(device, backend, blocks, id=f"{device}-{backend}-{blocks}", marks=marks)
    for device, backend, marks in (
        ("cpu", "triton", ()),
        ("cuda", "triton", pytest.mark.cuda),
        ("cuda", "cuda", pytest.mark.cuda),
    )
    for blocks in (0, 3)
]


@pytest.mark.parametrize("device,backend,blocks", SCHEDULES)
@pytest.mark.parametrize("mode", ["neutral", "propagate"])
def test_nonfinite_scores_on_every_schedule(device, backend, blocks, mode):
    """NaN/Inf scores: the GPU kernels' fused and split schedules give the eager
    backend's mask, gradients, held state and per-segment flags."""
    require_backend(backend, device)
    sizes, keep = [4, 2600, 5, 1], [2.0, 300.5, 1.5, 1.0]
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(sum(sizes), generator=gen)
    weights = torch.randn(sum(sizes), generator=gen)
    scores[2500], scores[2606] = float("nan"), float("inf")  # segment 1 (its 3rd chunk), 2
    out = {}
    for where, name in ((torch.device(device), backend), (torch.device("cpu"), "torch")):
        state = TransportState(sizes, device=where)
        s = scores.to(where).requires_grad_(True)
        schedule = {"blocks_per_segment": blocks} if name == backend else {}
        mask = transport_mask(s, keep, state, backend=name, nonfinite=mode, **schedule)
        (weights.to(where) * mask.nan_to_num(0.0)).sum().backward()
        state.commit()
        out[name] = [t.detach().cpu() for t in (mask, s.grad, state.log_odds, state.shift)]
        assert state.skipped_steps.tolist() == [0, 1, 1, 0]
    if mode == "propagate":  # gradients through a NaN segment are NaN in no fixed pattern
        del out[backend][1], out["torch"][1]
    for a, b in zip(out[backend], out["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    if mode == "neutral":
        assert torch.isfinite(out[backend][0]).all() and out[backend][1][[2500, 2606]].eq(0).all()


@pytest.mark.parametrize("backend", cuda_backends())
@pytest.mark.cuda
def test_bitwise_identical_runs_on_cuda(backend):
    sizes = [70_000, 5, 40_000, 1, 4096]
    keep = [30_000.5, 2.0, 100.0, 1.0, 7.0]
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0)).to(CUDA)
    results = []
    for _ in range(2):
        state = TransportState(sizes, device=CUDA)
        s = scores.clone().requires_grad_(True)
        mask = transport_mask(s, keep, state, backend=backend)
        mask.square().sum().backward()
        results.append(
            (mask.detach(), s.grad, state.pending_log_odds.clone(), state.pending_shift.clone())
        )
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_matches_triton():
    if not {"cuda", "triton"} <= set(cuda_backends()):
        pytest.skip("needs both the CUDA and the Triton backend")
    sizes = [n for n, _ in RAGGED_LAYOUT]
    keep = torch.tensor([k for _, k in RAGGED_LAYOUT], device=CUDA)
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(5)).to(CUDA)
    out = {}
    for backend in ("cuda", "triton"):
        s = scores.clone().requires_grad_(True)
        state = TransportState(sizes, device=CUDA)
        mask = transport_mask(s, keep, state, backend=backend)
        mask.square().sum().backward()
        out[backend] = (mask.detach(), s.grad, state.pending_log_odds, state.pending_shift)
    for a, b in zip(out["cuda"], out["triton"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


# -- bad input -----------------------------------------------------------------------

SIZES = [3, 5]


@pytest.fixture
def state():
    s = TransportState(SIZES)
    transport_mask(torch.randn(8), [1.0, 2.0], s)
    s.commit()
    transport_mask(torch.randn(8), [1.0, 2.0], s)  # a pending step exists
    return s


def snapshot(state):
    return {k: v.clone() for k, v in state.state_dict().items()}


CASES = [
    # (kwargs, error type, message pattern)
    (dict(scores=torch.randn(8, 1)), ValueError, r"scores must be 1-D, got shape \(8, 1\)"),
    (dict(scores=torch.randn(9)), ValueError, r"scores has 9 entries.*expects 8"),
    (dict(scores=[torch.randn(3)]), ValueError, r"scores has 1 segments.*has 2"),
    (
        dict(scores=[torch.randn(3), torch.randn(4)]),
        ValueError,
        r"scores\[1\] \(segment 1\) has 4 entries.*n = 5",
    ),
    (
        dict(scores=[torch.randn(3), torch.randn(5, 1)]),
        ValueError,
        r"scores\[1\] \(segment 1\) must be 1-D",
    ),
    (dict(scores=torch.arange(8)), TypeError, r"scores has dtype torch.int64; allowed: float16"),
    (
        dict(scores=torch.randn(8, dtype=torch.complex64)),
        TypeError,
        r"scores has dtype torch.complex64",
    ),
    (dict(scores="abc"), TypeError, r"scores must be a 1-D tensor"),
    (
        dict(keep=[1.0, 6.0]),
        ValueError,
        r"keep\[1\] \(segment 1\) = 6.0 is outside the allowed range \[0, 5\]",
    ),
    (
        dict(keep=[-0.5, 2.0]),
        ValueError,
        r"keep\[0\] \(segment 0\) = -0.5 is outside the allowed range \[0, 3\]",
    ),
    (
        dict(keep=torch.tensor([float("nan"), 2.0])),
        ValueError,
        r"keep\[0\] \(segment 0\) = nan is outside",
    ),
    (dict(keep=[1.0]), ValueError, r"keep has 1 entries, one per segment is needed \(2\)"),
    (dict(keep=torch.tensor([1, 2])), TypeError, r"keep has dtype torch.int64"),
    (dict(keep=[1.0, "2"]), TypeError, r"keep\[1\] \(segment 1\) = '2' is not a real number"),
    (dict(eps=0.0), ValueError, r"eps\[0\] \(segment 0\) = 0.0; eps must be finite and > 0"),
    (
        dict(eps=[1.0, -2.0]),
        ValueError,
        r"eps\[1\] \(segment 1\) = -2.0; eps must be finite and > 0",
    ),
    (dict(eps=float("inf")), ValueError, r"eps\[0\] \(segment 0\) = inf"),
    (dict(eps=[1.0, 1.0, 1.0]), ValueError, r"eps has 3 entries, the state has 2 segments"),
    (dict(iters=0), ValueError, r"iters = 0; it must be an int >= 1"),
    (dict(iters=1.5), ValueError, r"iters = 1.5; it must be an int >= 1"),
    (dict(update="yes"), TypeError, r"update must be a bool"),
    (
        dict(nonfinite="zero"),
        ValueError,
        r"nonfinite = 'zero'; allowed: \['propagate', 'neutral'\]",
    ),
    (
        dict(backend="fast"),
        ValueError,
        r"backend = 'fast'; allowed: \['auto', 'reference', 'torch', 'cpu'",
    ),
    (dict(state=object()), TypeError, r"state must be a TransportState"),
]


@pytest.mark.parametrize("kwargs,error,pattern", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_raises_and_leaves_state(state, kwargs, error, pattern):
    args = dict(scores=torch.randn(8), keep=[1.0, 2.0], state=state, eps=1.0, iters=1)
    args.update(kwargs)
    before = snapshot(state)
    with pytest.raises(error, match=pattern):
        transport_mask(**args)
    after = snapshot(state)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_scores_on_another_device_than_state(state):
    meta_scores = torch.randn(8, device="meta")
    before = snapshot(state)
    with pytest.raises(ValueError, match=r"scores is on meta but the transport state is on cpu"):
        transport_mask(meta_scores, [1.0, 2.0], state)
    assert all(torch.equal(v, snapshot(state)[k]) for k, v in before.items())


def test_eps_requiring_grad_is_refused(state):
    with pytest.raises(ValueError, match="eps must not require grad"):
        transport_mask(torch.randn(8), [1.0, 2.0], state, eps=torch.ones(2, requires_grad=True))


def test_compiled_op_checks_its_own_inputs():
    """Calling torch.ops.dtp directly still gets range checks, not undefined behaviour."""
    pytest.importorskip("dtp_kernels._C")
    offsets = torch.tensor([0, 3, 8])
    scores, d, shift = torch.randn(8), torch.zeros(8), torch.zeros(2)
    eps = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"keep\[1\] = 6 is outside \[0, 5\]"):
        torch.ops.dtp.transport_mask(scores, offsets, torch.tensor([1.0, 6.0]), eps, d, shift, 1)
    with pytest.raises(
        RuntimeError, match=r"offsets must start at 0 and end at scores.numel\(\) = 8"
    ):
        torch.ops.dtp.transport_mask(
            scores, torch.tensor([0, 3, 7]), torch.tensor([1.0, 2.0]), eps, d, shift, 1
        )
    with pytest.raises(RuntimeError, match=r"iters must be >= 1"):
        torch.ops.dtp.transport_mask(scores, offsets, torch.tensor([1.0, 2.0]), eps, d, shift, 0)
    with pytest.raises(RuntimeError, match=r"blocks_per_segment must be >= 0"):
        torch.ops.dtp.transport_mask(
            scores, offsets, torch.tensor([1.0, 2.0]), eps, d, shift, 1, False, -1
        )
    with pytest.raises(RuntimeError, match=r"shift must be Float with one entry per segment"):
        torch.ops.dtp.transport_mask(
            scores, offsets, torch.tensor([1.0, 2.0]), eps, d, shift.double(), 1
        )


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu"])
def test_blocks_per_segment_belongs_to_the_gpu_backends(state, backend):
    """The schedule argument is the cuda and triton backends'; others refuse a non-zero
    value by name, and a bad value is refused on every backend before the state changes."""
    if backend == "cpu":
        pytest.importorskip("dtp_kernels._C")
    before = snapshot(state)
    with pytest.raises(ValueError, match=r"blocks_per_segment = 2 picks a schedule of the cuda"):
        transport_mask(torch.randn(8), [1.0, 2.0], state, backend=backend, blocks_per_segment=2)
    with pytest.raises(ValueError, match=r"blocks_per_segment = -1; it must be an int >= 0"):
        transport_mask(torch.randn(8), [1.0, 2.0], state, backend=backend, blocks_per_segment=-1)
    assert all(torch.equal(v, snapshot(state)[k]) for k, v in before.items())
    # 0 is every backend's default
    transport_mask(torch.randn(8), [1.0, 2.0], state, backend=backend, blocks_per_segment=0)


def test_triton_schedule_needs_one_iteration(state):
    """Triton's kernels do iters = 1; a forced schedule with iters > 1 (which runs the
    eager closed form) is refused, before the state changes."""
    require_backend("triton", "cpu")
    before = snapshot(state)
    with pytest.raises(ValueError, match=r"iters = 3 runs the eager closed form, so blocks_per"):
        transport_mask(
            torch.randn(8), [1.0, 2.0], state, iters=3, backend="triton", blocks_per_segment=2
        )
    assert all(torch.equal(v, snapshot(state)[k]) for k, v in before.items())
