"""torch.library.opcheck on the compiled ops: schema, fake tensors, autograd registration."""

import pytest
import torch

import dtp_kernels
from utils import CUDA, cuda_backends

pytestmark = pytest.mark.skipif(
    "cpu" not in dtp_kernels.available_backends("cpu"), reason="dtp_kernels._C is not built"
)


def sample_inputs(dtype, iters, requires_grad):
    sizes = [1, 3, 17, 5]
    offsets = torch.tensor([0, 1, 4, 21, 26])
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scores = torch.randn(26).to(dtype).requires_grad_(requires_grad)
    keep = torch.tensor([1.0, 1.5, 4.0, 0.0], dtype=acc, requires_grad=requires_grad)
    eps = torch.full((len(sizes),), 0.5, dtype=torch.float64)
    log_odds = torch.randn(26, dtype=acc)
    shift = torch.randn(len(sizes), dtype=acc)
    return (scores, offsets, keep, eps, log_odds, shift, iters)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_transport_mask(dtype, iters, requires_grad):
    args = sample_inputs(dtype, iters, requires_grad)
    torch.library.opcheck(torch.ops.dtp.transport_mask.default, args)
    # the schedule argument passes through autograd and the fake kernel too
    torch.library.opcheck(torch.ops.dtp.transport_mask.default, (*args, False, 3))


@pytest.mark.parametrize("iters", [1, 3])
def test_opcheck_transport_mask_neutral_nonfinite(iters):
    """NaN and Inf scores read as 0.5: every output and gradient finite, segments flagged."""
    scores, offsets, keep, eps, log_odds, shift, _ = sample_inputs(torch.float32, iters, True)
    with torch.no_grad():
        scores[2], scores[10] = float("nan"), float("inf")
    args = (scores, offsets, keep, eps, log_odds, shift, iters, True)
    torch.library.opcheck(torch.ops.dtp.transport_mask.default, args)
    *_, nonfinite = torch.ops.dtp.transport_mask(*args)
    assert nonfinite.tolist() == [False, True, True, False]


def test_opcheck_transport_mask_backward():
    scores, offsets, keep, eps, log_odds, shift, iters = sample_inputs(torch.float32, 2, False)
    mask, _, _, stats, _ = torch.ops.dtp.transport_mask(
        scores, offsets, keep, eps, log_odds, shift, iters
    )
    grad = torch.randn(26)
    for neutral in (False, True):
        torch.library.opcheck(
            torch.ops.dtp.transport_mask_backward.default,
            (grad, scores, offsets, keep, eps, log_odds, stats, neutral),
        )
        torch.library.opcheck(
            torch.ops.dtp.transport_mask_backward.default,
            (grad, scores, offsets, keep, eps, log_odds, stats, neutral, 2),
        )
        torch.library.opcheck(
            torch.ops.dtp.transport_mask_backward.default,
            (grad, scores, offsets, keep, eps, log_odds, stats, neutral, 0, 0, mask),
        )


def nm_inputs(dtype, iters):
    """Seven segments of 4 (the tiny-segment kernels: a CPU tile of 32 is not filled, so the
    one-segment tail runs), one of them degenerate (k = 0)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scores = torch.randn(28).to(dtype)
    keep = torch.tensor([2.0, 1.0, 3.0, 0.0, 2.0, 2.5, 1.5], dtype=acc)
    eps = torch.full((7,), 0.5, dtype=torch.float64)
    offsets = torch.arange(0, 29, 4)
    return (
        scores,
        offsets,
        keep,
        eps,
        torch.randn(28, dtype=acc),
        torch.randn(7, dtype=acc),
        iters,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("neutral", [False, True])
@pytest.mark.parametrize("layout", ["segments", "n:m"])
def test_backward_from_the_mask_matches_the_recomputed_terms(dtype, iters, neutral, layout):
    """The CPU backward given the forward's mask (p = mask / k, q = p (1 - S1 p)) agrees
    with the one that recomputes p and q from scores and log-odds: degenerate segments
    (k = 0, n = 1), saturated scores and a NaN read as neutral included; general and
    tiny-segment (N:M) kernels."""
    if layout == "segments":
        scores, offsets, keep, eps, log_odds, shift, _ = sample_inputs(dtype, iters, False)
        size = 0
    else:
        scores, offsets, keep, eps, log_odds, shift, _ = nm_inputs(dtype, iters)
        size = 4
    with torch.no_grad():
        scores[5] = 40.0  # sigmoid(-z) underflows against 1 in float32
        scores[6] = -40.0
        if neutral:
            scores[9] = float("nan")
    args = (scores, offsets, keep, eps, log_odds, shift, iters, neutral, 0, size)
    mask, _, _, stats, _ = torch.ops.dtp.transport_mask(*args)
    grad = torch.randn(scores.numel(), dtype=torch.float64).to(mask.dtype)
    common = (grad, scores, offsets, keep, eps, log_odds, stats, neutral, 0, size)
    recomputed = torch.ops.dtp.transport_mask_backward(*common)
    from_mask = torch.ops.dtp.transport_mask_backward(*common, mask)
    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-5, 1e-6)
    for got, want in zip(from_mask, recomputed, strict=True):
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)
    if dtype in (torch.float32, torch.float64) and layout == "segments" and iters == 1:
        # the mask in the compute dtype is used for one pass (the tiny-segment kernels
        # and more passes recompute)
        moved = mask.clone()
        moved[16:20] *= 2.0  # in a segment with 0 < k < n in both layouts
        changed = torch.ops.dtp.transport_mask_backward(*common, moved)
        assert not torch.equal(changed[0][16:20], from_mask[0][16:20])


def test_backward_rejects_a_mask_of_the_wrong_size():
    scores, offsets, keep, eps, log_odds, shift, iters = sample_inputs(torch.float32, 1, False)
    mask, _, _, stats, _ = torch.ops.dtp.transport_mask(
        scores, offsets, keep, eps, log_odds, shift, iters
    )
    common = (torch.randn(26), scores, offsets, keep, eps, log_odds, stats, False, 0, 0)
    with pytest.raises(RuntimeError, match="mask has 25 elements, expected 26"):
        torch.ops.dtp.transport_mask_backward(*common, mask[:25])


def test_changing_the_mask_in_place_makes_backward_raise():
    """The backward reads the saved mask: an in-place change is caught, as for any saved
    output, instead of giving a gradient of the changed values."""
    state = dtp_kernels.TransportState([4, 6])
    scores = torch.randn(10, requires_grad=True)
    mask = dtp_kernels.transport_mask(scores, [2.0, 3.0], state, backend="cpu")
    mask.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        mask.sum().backward()


def test_autograd_node_records_the_mask_only_and_frees_what_it_saved():
    """One backward node, on the mask: the next state, stats and flags carry no gradient;
    the gradients of scores and keep are what autograd asked for; a second backward
    raises (the saved tensors are freed), as for torch's own ops."""
    scores, offsets, keep, eps, log_odds, shift, iters = sample_inputs(torch.float64, 1, True)
    outputs = torch.ops.dtp.transport_mask(scores, offsets, keep, eps, log_odds, shift, iters)
    assert outputs[0].grad_fn.name() == "dtp::TransportMaskBackward"
    assert not any(t.requires_grad for t in outputs[1:])
    g = torch.randn(26, dtype=torch.float64)
    grad_scores, grad_keep = torch.autograd.grad(outputs[0], (scores, keep), g, retain_graph=True)
    only_keep = torch.autograd.grad(outputs[0], keep, g)[0]
    torch.testing.assert_close(only_keep, grad_keep, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(outputs[0], scores, g)
    frozen = keep.detach()
    mask = torch.ops.dtp.transport_mask(scores, offsets, frozen, eps, log_odds, shift, iters)[0]
    torch.testing.assert_close(torch.autograd.grad(mask, scores, g)[0], grad_scores, rtol=0, atol=0)


def test_torch_func_grad_equals_autograd():
    """torch.func.grad runs through the same backward node and gives autograd's gradient."""
    state = dtp_kernels.TransportState([5, 7])
    scores = torch.rand(12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(s: torch.Tensor) -> torch.Tensor:
        mask = dtp_kernels.transport_mask(s, [2.0, 3.5], state, backend="cpu", update=False)
        return (mask * g).sum()

    leaf = scores.clone().requires_grad_(True)
    expected = torch.autograd.grad(loss(leaf), leaf)[0]
    torch.testing.assert_close(torch.func.grad(loss)(scores), expected, rtol=1e-12, atol=0)


def test_forward_mode_ad_is_refused():
    """No forward-mode formula: dual scores raise instead of losing their tangent."""
    import torch.autograd.forward_ad as forward_ad

    state = dtp_kernels.TransportState([4, 6])
    scores = torch.randn(10, dtype=torch.float64)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(scores, torch.ones_like(scores))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            dtp_kernels.transport_mask(dual, [2.0, 3.0], state, backend="cpu", update=False)


def test_deterministic_and_thread_independent():
    """Chunk partials are merged in a fixed order: bitwise equal across runs and threads."""
    sizes = [70_000, 5, 40_000]
    state = dtp_kernels.TransportState(sizes)
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    keep = [30_000.5, 2.0, 100.0]
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, threads, 1, threads):
            torch.set_num_threads(n_threads)
            s = scores.clone().requires_grad_(True)
            mask = dtp_kernels.transport_mask(s, keep, state, iters=2, backend="cpu")
            mask.pow(2).sum().backward()
            results.append(
                (mask.detach(), s.grad, state.pending_log_odds.clone(), state.pending_shift.clone())
            )
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.cuda
def test_opcheck_cuda_kernels():
    if "cuda" not in cuda_backends():
        pytest.skip("the CUDA kernels are not built")
    scores = torch.randn(26, device=CUDA, requires_grad=True)
    offsets = torch.tensor([0, 1, 4, 21, 26], device=CUDA)
    keep = torch.tensor([1.0, 1.5, 4.0, 0.0], device=CUDA, requires_grad=True)
    eps = torch.full((4,), 0.5, dtype=torch.float64, device=CUDA)
    log_odds, shift = torch.randn(26, device=CUDA), torch.randn(4, device=CUDA)
    for iters in (1, 3):
        for neutral in (False, True):
            torch.library.opcheck(
                torch.ops.dtp.transport_mask.default,
                (scores, offsets, keep, eps, log_odds, shift, iters, neutral),
            )
    y = torch.randn(2, 4, 3, 3, device=CUDA, requires_grad=True)
    mask = torch.rand(4, device=CUDA, requires_grad=True)
    torch.library.opcheck(torch.ops.dtp.masked_channel_epilogue.default, (y, mask, None, "relu", 1))
