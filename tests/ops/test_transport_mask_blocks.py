"""transport_mask on segments that all have one small size (4, 8 or 16: the blocks of
N:M sparsity), which the compiled backends run with kernels of their own (no offsets,
one tile of segments at a time): against the literal reference like every other path,
and against the general kernels on the same inputs.
"""

import pytest
import torch

import dtp_kernels
from dtp_kernels import TransportState, transport_mask
from utils import (
    check_fixed_scores_against_reference,
    check_low_precision,
    require_backend,
    run_loop,
)

compiled = pytest.mark.skipif(
    "cpu" not in dtp_kernels.available_backends("cpu"), reason="dtp_kernels._C is not built"
)


def blocks_layout(m: int, count: int) -> list[tuple[int, float]]:
    """`count` segments of size m with k cycling through 0, N:M's counts, fractions and m."""
    ks = [0.0, 1.0, m / 2, m - 1.0, float(m), 1.5, m / 4 + 0.25]
    return [(m, ks[i % len(ks)]) for i in range(count)]


def test_uniform_tiny_segments_choose_the_blocks_kernels():
    assert TransportState([4] * 10).segment_size == 4
    assert TransportState([8] * 3).segment_size == 8
    assert TransportState([16]).segment_size == 16
    assert TransportState([4, 8]).segment_size == 0  # not all alike
    assert TransportState([3] * 5).segment_size == 0  # no kernel of its own
    assert TransportState([32] * 5).segment_size == 0


# 37 segments: whole CPU tiles (one of 32 segments of 4, two of 16 of 8 or 16) and a
# partial one.
@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blocks_match_reference_over_a_training_loop(device_backend, m, iters, dtype):
    device, backend = device_backend
    steps = 8 if (device, backend) == ("cpu", "triton") else 40
    state, _ = run_loop(
        backend, dtype, iters, steps=steps, layout=blocks_layout(m, 37), device=device
    )
    assert state.segment_size == m


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_blocks_low_precision_scores_match_reference(device_backend, dtype):
    device, backend = device_backend
    check_low_precision(backend, dtype, device, layout=blocks_layout(4, 21))


# The compiled kernels for tiny segments: CPU tiles, one CUDA thread per segment.
COMPILED_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", COMPILED_DEVICES)
@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("m", [4, 16])
def test_blocks_gradcheck_float64(m, iters, device):
    require_backend(device, device)  # the cpu backend on CPU, cuda on a GPU
    # interior k only: finite differences in k must stay inside [0, n]
    layout = [(n, k) for n, k in blocks_layout(m, 24) if 0 < k < n][:19]
    sizes, keep = [n for n, _ in layout], [k for _, k in layout]
    state = TransportState(sizes, dtype=torch.float64, device=device)
    gen = torch.Generator().manual_seed(3)
    state.log_odds.copy_(torch.randn(state.numel, generator=gen, dtype=torch.float64))
    state.shift.copy_(torch.randn(len(sizes), generator=gen, dtype=torch.float64))
    scores = torch.rand(state.numel, generator=gen, dtype=torch.float64).to(device)
    scores.requires_grad_(True)
    k = torch.tensor(keep, dtype=torch.float64, device=device).requires_grad_(True)

    def step(s, k):
        return transport_mask(s, k, state, eps=0.7, iters=iters, update=False, backend=device)

    assert torch.autograd.gradcheck(step, (scores, k), atol=1e-7)


def general_twin(state: TransportState) -> TransportState:
    """A copy of `state` that the compiled backends run with the general kernels."""
    twin = TransportState(state.sizes, dtype=state.log_odds.dtype, device=state.device)
    twin.load_state_dict(state.state_dict())
    twin.segment_size = 0
    return twin


def step_both(state, twin, scores, keep, backend="cpu", **options):
    """One step with its gradient on the blocks kernels and on the general ones."""
    results = []
    for s in (state, twin):
        x = scores.clone().requires_grad_(True)
        k = keep.clone().requires_grad_(True)
        mask = transport_mask(x, k, s, backend=backend, **options)
        mask.backward(torch.linspace(-1, 1, mask.numel(), dtype=mask.dtype, device=mask.device))
        results.append((mask.detach(), x.grad, k.grad))
        s.commit()
    return results


@pytest.mark.parametrize(
    "device,backend",
    [
        pytest.param("cpu", "cpu", id="cpu"),
        pytest.param("cpu", "triton", id="triton"),
        pytest.param("cuda", "cuda", id="cuda-cuda", marks=pytest.mark.cuda),
        pytest.param("cuda", "triton", id="cuda-triton", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("nonfinite", ["propagate", "neutral"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_blocks_nonfinite_scores_as_the_general_kernels(device, backend, nonfinite, bad_value):
    """A segment with a NaN/Inf score keeps its state and is counted as skipped; the mask
    is NaN there (propagate) or finite with the score read as 0.5 (neutral)."""
    require_backend(backend, device)
    layout = blocks_layout(4, 70)
    state = TransportState([n for n, _ in layout], device=device)
    twin = general_twin(state)
    keep = torch.tensor([k for _, k in layout], device=device)
    scores = torch.rand(state.numel, generator=torch.Generator().manual_seed(5)).to(device)
    # segments 0, 40 (second CPU tile of 32) and 69 (partial tile)
    scores[[1, 161, 277]] = bad_value
    for _ in range(3):
        blocks, general = step_both(state, twin, scores, keep, backend, nonfinite=nonfinite)
        for a, b in zip(blocks, general, strict=True):
            assert torch.equal(a.isnan(), b.isnan())
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    skipped = state.skipped_steps
    assert torch.equal(skipped, twin.skipped_steps)
    assert skipped[[0, 40, 69]].tolist() == [3, 3, 3] and int(skipped.sum()) == 9
    if nonfinite == "neutral":
        assert torch.isfinite(blocks[0]).all() and torch.isfinite(blocks[1]).all()


@pytest.mark.parametrize("device", COMPILED_DEVICES)
def test_blocks_far_from_the_column_maxima_as_the_general_kernels(device):
    """Log-odds so negative that every z < -60: the form with two exps per element."""
    require_backend(device, device)
    layout = blocks_layout(8, 20)
    state = TransportState([n for n, _ in layout], device=device)
    state.log_odds.fill_(-90.0)
    state.log_odds[::3] = 500.0  # and some far above
    twin = general_twin(state)
    keep = torch.tensor([k for _, k in layout], device=device)
    scores = torch.rand(state.numel, generator=torch.Generator().manual_seed(6)).to(device)
    for _ in range(3):
        blocks, general = step_both(state, twin, scores, keep, device, iters=2)
        for a, b in zip(blocks, general, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.log_odds, twin.log_odds, rtol=1e-6, atol=1e-4)


@compiled
@pytest.mark.parametrize("m", [4, 16])
def test_blocks_split_over_threads_are_bitwise_equal_and_match_the_general_kernels(m):
    """Above 32,768 elements the segments are split over threads: the result does not
    depend on the thread count, and equals the general kernels up to rounding."""
    # a partial tile at the end; for m = 4, two threads splitting tiles of 16 segments
    # would cut one of the tiles of 32 the kernels run (707 of 16 each)
    nseg = 90_440 // m
    state = TransportState([m] * nseg)
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(state.numel, generator=gen)
    keep = torch.full((nseg,), m / 2)
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, max(threads, 2), 1):
            torch.set_num_threads(n_threads)
            s = scores.clone().requires_grad_(True)
            mask = transport_mask(s, keep, state, iters=2, backend="cpu")
            mask.pow(2).sum().backward()
            results.append((mask.detach(), s.grad, state.pending_log_odds.clone()))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
    twin = general_twin(state)
    s = scores.clone().requires_grad_(True)
    mask = transport_mask(s, keep, twin, iters=2, backend="cpu")
    mask.pow(2).sum().backward()
    torch.testing.assert_close(mask.detach(), results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.grad, results[0][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_blocks_rows_off_16_byte_alignment_equal_aligned_ones(device, m):
    """The one-segment tiles (every CUDA thread, the CPU's last partial tile) move whole
    16-byte rows when every tensor is 16-byte aligned and element by element otherwise:
    scores, mask gradient and state one float off alignment give the aligned inputs'
    mask, next state and score gradient bitwise."""
    require_backend(device, device)
    nseg = 32 * 3 + 5  # whole CPU tiles (32 segments of 4, 16 of 8 or 16) and a partial one
    sizes, n = [m] * nseg, m * nseg
    gen = torch.Generator().manual_seed(11)
    values, grads = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    keep = torch.tensor([k for _, k in blocks_layout(m, nseg)], device=device)
    results = []
    for offset in (0, 1):

        def placed(t: torch.Tensor, offset: int = offset) -> torch.Tensor:
            """t's values in fresh memory (aligned), or one float past its start."""
            view = torch.empty(n + offset, device=device)[offset:]
            return view.copy_(t)

        state = TransportState(sizes, device=device)
        transport_mask(placed(values) * 2, keep, state, backend=device)
        state.commit()  # a state off the uniform start
        state._buffers["log_odds"] = placed(state.log_odds)
        scores = placed(values).detach().requires_grad_(True)
        grad = placed(grads)
        assert (scores.data_ptr() % 16 == 0) == (offset == 0)
        mask = transport_mask(scores, keep, state, backend=device)
        mask.backward(grad)
        results.append((mask.detach(), scores.grad, state.pending_log_odds.clone()))
    for aligned, off in zip(*results, strict=True):
        assert torch.equal(aligned, off)


@compiled
def test_blocks_op_checks_its_arguments():
    scores, offsets = torch.rand(12), torch.tensor([0, 4, 8, 12])
    keep, eps = torch.tensor([2.0, 2.0, 2.0]), torch.ones(3, dtype=torch.float64)
    log_odds, shift = torch.zeros(12), torch.zeros(3)
    op = torch.ops.dtp.transport_mask
    with pytest.raises(RuntimeError, match=r"segment_size must be 0 .* 4, 8 or 16, got 5"):
        op(scores, offsets, keep, eps, log_odds, shift, 1, False, 0, 5)
    with pytest.raises(RuntimeError, match="segment_size 8 with 3 segments needs 24 scores"):
        op(scores, offsets, keep, eps, log_odds, shift, 1, False, 0, 8)
    with pytest.raises(RuntimeError, match=r"keep\[1\] = 4.5 is outside \[0, 4\]"):
        op(scores, offsets, torch.tensor([2.0, 4.5, 1.0]), eps, log_odds, shift, 1, False, 0, 4)
    bad_eps = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"eps\[2\] = 0 must be finite and > 0"):
        op(scores, offsets, keep, bad_eps, log_odds, shift, 1, False, 0, 4)
    mask, *_ = op(scores, offsets, keep, eps, log_odds, shift, 1, False, 0, 4)
    torch.testing.assert_close(mask.view(3, 4).sum(1), keep)


@pytest.mark.parametrize("device", COMPILED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("iters", [1, 3])
def test_opcheck_blocks(dtype, iters, device):
    require_backend(device, device)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    nseg = 19
    args = (
        torch.randn(nseg * 4, device=device).to(dtype).requires_grad_(True),
        torch.arange(nseg + 1, device=device) * 4,
        torch.full((nseg,), 2.0, dtype=acc, device=device, requires_grad=True),
        torch.full((nseg,), 0.5, dtype=torch.float64, device=device),
        torch.randn(nseg * 4, dtype=acc, device=device),
        torch.randn(nseg, dtype=acc, device=device),
        iters,
        False,
        0,
        4,
    )
    torch.library.opcheck(torch.ops.dtp.transport_mask.default, args)


@pytest.mark.parametrize("device", COMPILED_DEVICES)
@pytest.mark.parametrize("m", [4, 16])
@pytest.mark.parametrize("iters", [1, 3])
def test_blocks_stats_segments_innermost_and_any_layout_accepted(device, m, iters):
    """The tile kernels lay their (nseg, iters, 3) stats out with the segments innermost
    (a tile's values of one kind consecutive), as the fake implementation says; their
    backward given the same values in another layout (contiguous, or a strided view)
    returns bitwise the same gradients."""
    require_backend(device, device)
    nseg = 53  # whole tiles and a partial one on the CPU
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(nseg * m, generator=gen).to(device)
    offsets = torch.arange(nseg + 1, device=device) * m
    keep = torch.tensor([k for _, k in blocks_layout(m, nseg)], device=device)
    eps = torch.full((nseg,), 0.5, dtype=torch.float64, device=device)
    log_odds = torch.randn(nseg * m, generator=gen).to(device)
    shift = torch.randn(nseg, generator=gen).to(device)
    grad = torch.randn(nseg * m, generator=gen).to(device)
    args = (scores, offsets, keep, eps, log_odds, shift, iters, False, 0, m)
    stats = torch.ops.dtp.transport_mask(*args)[3]
    assert stats.shape == (nseg, iters, 3)
    assert stats.stride() == (1, 3 * nseg, nseg)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.dtp.transport_mask(
            *(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args)
        )
    assert fake[3].stride() == stats.stride()

    def backward(saved):
        return torch.ops.dtp.transport_mask_backward(
            grad, scores, offsets, keep, eps, log_odds, saved, False, 0, m
        )

    expected = backward(stats)
    wide = torch.zeros(nseg, iters, 6, device=device)
    wide[..., ::2] = stats
    # passes outermost, then segments: only the segments' stride is as the kernels read
    passes_first = torch.empty(3, iters, nseg, device=device).permute(2, 1, 0)
    passes_first.copy_(stats)
    # the kernels' order with a gap after each pass: only the passes' stride differs
    padded = torch.empty(iters, 4, nseg, device=device)[:, :3].permute(2, 0, 1)
    padded.copy_(stats)
    for saved in (stats.contiguous(), wide[..., ::2], passes_first, padded):
        for got, want in zip(backward(saved), expected, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("device", COMPILED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("iters", [1, 3])
def test_blocks_stats_in_the_compute_dtype_and_forced_general_kernels(dtype, iters, device):
    """The tile kernels return their stats in the compute dtype, the general kernels
    (which blocks_per_segment > 0 selects on every device) in float64; both give the same
    step up to rounding, and each backward refuses the other's stats with an error naming
    the dtype and shape it expects."""
    require_backend(device, device)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    nseg = 37
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(nseg * 4, generator=gen).to(device=device, dtype=dtype)
    offsets = torch.arange(nseg + 1, device=device) * 4
    keep = torch.tensor([k for _, k in blocks_layout(4, nseg)], dtype=acc, device=device)
    eps = torch.full((nseg,), 0.5, dtype=torch.float64, device=device)
    log_odds = torch.randn(nseg * 4, generator=gen).to(device=device, dtype=acc)
    shift = torch.randn(nseg, generator=gen).to(device=device, dtype=acc)
    grad = torch.randn(nseg * 4, generator=gen).to(device=device, dtype=dtype)
    out = {}
    for blocks, stats_dtype in ((0, acc), (1, torch.float64)):
        step = torch.ops.dtp.transport_mask(
            scores, offsets, keep, eps, log_odds, shift, iters, False, blocks, 4
        )
        stats = step[3]
        assert stats.dtype == stats_dtype and stats.shape == (nseg, iters, 3)
        grads = torch.ops.dtp.transport_mask_backward(
            grad, scores, offsets, keep, eps, log_odds, stats, False, blocks, 4
        )
        out[blocks] = (*step[:3], step[4], *grads)
        if acc == torch.float64:
            continue  # both kernels' stats are float64
        wrong = stats.to(acc if stats_dtype == torch.float64 else torch.float64)
        with pytest.raises(RuntimeError, match=rf"stats must be .* of shape \({nseg}, iters, 3\)"):
            torch.ops.dtp.transport_mask_backward(
                grad, scores, offsets, keep, eps, log_odds, wrong, False, blocks, 4
            )
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    for tile, general in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(tile, general, **tol)


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize(
    "device",
    [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.cuda)],
)
def test_forced_schedule_runs_tiny_segments_on_the_general_triton_kernels(
    device, blocks, monkeypatch
):
    """blocks_per_segment > 0 runs N:M segments on Triton's general kernels (which choose
    their schedule with programs_per_segment; the tile kernel does not): the same masks,
    gradients and state as the tile kernel, up to rounding."""
    require_backend("triton", device)
    from dtp_kernels.kernels import transport_mask_triton as tk

    chosen = []
    choose = tk.programs_per_segment
    monkeypatch.setattr(
        tk, "programs_per_segment", lambda *args: chosen.append(args[2]) or choose(*args)
    )
    sizes = [4] * 37
    keep = torch.tensor([k for _, k in blocks_layout(4, 37)], device=device)
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(6)).to(device)
    out = []
    for schedule in (0, blocks):
        state = TransportState(sizes, device=device)
        s = scores.clone().requires_grad_(True)
        mask = transport_mask(s, keep, state, backend="triton", blocks_per_segment=schedule)
        mask.square().sum().backward()
        out.append((mask.detach(), s.grad, state.pending_log_odds, state.pending_shift))
    assert chosen == [blocks, blocks]  # forward and backward of the forced run only
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_far_below_both_columns_match_reference(device_backend, dtype):
    """N:M segments whose every z is near -100 or +100 (sigmoid underflows in float32):
    the tile kernels must scale the sums, against the float64 reference over 3 steps;
    beside them segments in the usual range, in the same tiles."""
    m, count = 4, 37
    gen = torch.Generator().manual_seed(9)
    far = torch.rand(count, 1, generator=gen, dtype=torch.float64) < 0.5
    low = 0.05 * torch.rand(count, m, generator=gen, dtype=torch.float64)  # x near -100
    usual = 0.4 + 0.2 * torch.rand(count, m, generator=gen, dtype=torch.float64)
    scores = torch.where(far, low, usual)
    scores[::5] = 1.0 - scores[::5] * 0.05 / 0.6  # some blocks near +100
    scores = scores.flatten()
    device, backend = device_backend
    state = check_fixed_scores_against_reference(
        backend, [m] * count, [2.0] * count, scores, 0.01, dtype, device=device
    )
    assert state.segment_size == m
