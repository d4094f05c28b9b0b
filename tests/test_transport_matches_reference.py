"""Every backend equals the literal reference in values and gradients over a training loop."""

import pytest
import torch

from conftest import ALL_CPU_BACKENDS, FAST_CPU_BACKENDS, RAGGED_LAYOUT
from dtp_kernels import TransportState, transport_mask

# Tolerances of a backend computing in `dtype` against the float64 reference. In float32
# the carried log-odds grow with the step count (about |2s - 1| / eps per step), so their
# rounding error grows too: after 200 steps masks and score gradients differ by up to 2e-4
# with eager torch and 2e-5 with the C++ kernels (the README states these figures).
TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-3, 3e-4)}


def run_loop(backend, dtype, iters, steps, layout=RAGGED_LAYOUT, lr=0.05, seed=0, device="cpu"):
    """Train scores on a fixed linear loss; compare each step with the reference.

    Both paths see the same scores every step (updated with the reference gradient), so
    a difference is the backend's alone; the two states evolve independently.
    """
    gen = torch.Generator().manual_seed(seed)
    sizes = [n for n, _ in layout]
    keep = torch.tensor([k for _, k in layout], dtype=torch.float64)
    total = sum(sizes)
    scores = torch.rand(total, generator=gen, dtype=torch.float64)
    weights = torch.randn(total, generator=gen, dtype=torch.float64)
    ref_state = TransportState(sizes, dtype=torch.float64)
    state = TransportState(sizes, dtype=dtype, device=device)
    rtol, atol = TOLERANCES[dtype]
    for step in range(steps):
        s_ref = scores.clone().requires_grad_(True)
        k_ref = keep.clone().requires_grad_(True)
        m_ref = transport_mask(s_ref, k_ref, ref_state, iters=iters, backend="reference")
        (weights * m_ref).sum().backward()

        s = scores.to(device, dtype).clone().requires_grad_(True)
        k = keep.to(device, dtype).clone().requires_grad_(True)
        m = transport_mask(s, k, state, iters=iters, backend=backend)
        (weights.to(device, dtype) * m).sum().backward()

        msg = f"{backend} step {step}"
        got = (m.detach(), s.grad, k.grad)
        want = (m_ref.detach(), s_ref.grad, k_ref.grad)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.double().cpu(), b, rtol=rtol, atol=atol, msg=msg)
        ref_state.commit()
        state.commit()
        scores = scores - lr * s_ref.grad
    torch.testing.assert_close(state.shift.double().cpu(), ref_state.shift, rtol=rtol, atol=atol)
    return state, ref_state


@pytest.mark.parametrize("iters", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_200_steps_match_reference(fast_backend, dtype, iters):
    # The Triton interpreter costs ~2 ms per program instance: 60 steps keep CI short
    # (on CUDA, tests/test_gpu.py runs the full 200).
    steps = 60 if fast_backend == "triton" else 200
    state, ref_state = run_loop(fast_backend, dtype, iters, steps=steps)
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
def test_low_precision_scores_match_reference(fast_backend, dtype):
    check_low_precision(fast_backend, dtype)


def check_low_precision(backend, dtype, device="cpu"):
    """fp16/bf16 scores: math in fp32; the result only carries the output rounding."""
    tolerance = {
        torch.float16: (2e-3, 1e-3),
        torch.bfloat16: (1.6e-2, 8e-3),
        torch.float32: (2e-5, 2e-6),
    }
    rtol, atol = tolerance[dtype]
    sizes = [n for n, _ in RAGGED_LAYOUT]
    keep = [k for _, k in RAGGED_LAYOUT]
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(sum(sizes), generator=gen).to(dtype)
    ref = transport_mask(scores.double(), keep, TransportState(sizes), backend="reference")
    s = scores.to(device).requires_grad_(True)
    mask = transport_mask(s, keep, TransportState(sizes, device=device), backend=backend)
    assert mask.dtype == dtype
    torch.testing.assert_close(mask.double().cpu(), ref, rtol=rtol, atol=atol)
    mask.float().pow(2).sum().backward()
    assert s.grad.dtype == dtype and torch.isfinite(s.grad.float()).all()


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
