"""keep and eps shared by all segments: a float eps, and a keep expand()ed from one value
(as DTPPruner's N:M counts are), reach the kernels as stride-0 views that they read once
instead of once per segment. Every backend must give what per-segment copies of the
same values give, bitwise, on the tiny-segment (N:M) kernels and on the general ones.
"""

import pytest
import torch

import dtp_kernels
from dtp_kernels import DTPPruner, TransportState, transport_mask
from dtp_kernels.transport_mask import _check_eps
from utils import require_backend

BACKENDS = [
    pytest.param(("cpu", b), id=f"cpu-{b}") for b in ("reference", "torch", "cpu", "triton")
] + [pytest.param(("cuda", b), id=f"cuda-{b}", marks=pytest.mark.cuda) for b in ("cuda", "triton")]

# 37 segments of 4 (the N:M kernels: whole CPU tiles and a partial one), and segments of
# several sizes (the general kernels)
LAYOUTS = {"blocks of 4": [4] * 37, "general": [5, 3, 9, 4, 17, 6, 3, 8]}


def steps(state, scores, keep, eps, backend, **options) -> list[torch.Tensor]:
    """Three committed steps with their gradients: every mask, state and gradient."""
    out = []
    for step in range(3):
        x = scores.clone().requires_grad_(True)
        mask = transport_mask(x, keep, state, eps=eps, backend=backend, **options)
        g = torch.linspace(-1, 1, mask.numel(), dtype=mask.dtype, device=mask.device)
        mask.backward(g * (step + 1))
        state.commit()
        out += [mask.detach(), x.grad, state.log_odds.clone(), state.shift.clone()]
    return out


@pytest.mark.parametrize("device_backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_keep_and_eps_give_what_per_segment_copies_give(device_backend, layout, dtype):
    device, backend = device_backend
    require_backend(backend, device)
    sizes = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(11)
    scores = torch.rand(sum(sizes), generator=gen, dtype=dtype).to(device)
    shared_k = torch.tensor([2.0], dtype=dtype, device=device, requires_grad=True)
    own_k = torch.full((len(sizes),), 2.0, dtype=dtype, device=device, requires_grad=True)
    shared = TransportState(sizes, dtype=dtype, device=device)
    own = TransportState(sizes, dtype=dtype, device=device)
    keep = shared_k.expand(len(sizes))
    assert keep.stride() == (0,) and _check_eps(0.7, shared).stride() == (0,)
    results = steps(shared, scores, keep, 0.7, backend)
    expected = steps(own, scores, own_k, [0.7] * len(sizes), backend)
    for got, want in zip(results, expected, strict=True):
        assert torch.equal(got, want)
    # the expand's backward sums the per-segment keep gradients (in another order: the
    # steps' sums added where the other adds up each segment's three steps)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(shared_k.grad, own_k.grad.sum().reshape(1), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "device,backend",
    [
        pytest.param("cpu", "triton", id="cpu-triton"),
        pytest.param("cuda", "cuda", id="cuda-cuda", marks=pytest.mark.cuda),
        pytest.param("cuda", "triton", id="cuda-triton", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("blocks", [1, 3])
def test_shared_keep_and_eps_on_forced_schedules(device, backend, blocks):
    """N:M segments run on the general kernels' fused (1) and split (3) schedules."""
    require_backend(backend, device)
    sizes = [4] * 37
    scores = torch.rand(sum(sizes), generator=torch.Generator().manual_seed(2)).to(device)
    keep = torch.tensor([2.0], device=device).expand(len(sizes))
    options = {"blocks_per_segment": blocks}
    results = steps(TransportState(sizes, device=device), scores, keep, 0.7, backend, **options)
    own = TransportState(sizes, device=device)
    expected = steps(own, scores, keep.contiguous(), [0.7] * 37, backend, **options)
    for got, want in zip(results, expected, strict=True):
        assert torch.equal(got, want)


def test_a_float_eps_is_held_once():
    state = TransportState([4] * 1000)
    eps = _check_eps(0.5, state)
    assert eps.shape == (1000,) and eps.stride() == (0,)
    assert eps.untyped_storage().nbytes() == 8  # one float64, not one per segment
    assert torch.equal(eps, torch.full((1000,), 0.5, dtype=torch.float64))
    assert _check_eps([0.5] * 1000, state).stride() == (1,)  # a value per segment stays so


def test_nm_pruner_holds_n_once_and_reads_it_per_block():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    pruner = DTPPruner(model, torch.randn(2, 16), 0.5, granularity="n:m", nm=(2, 4))
    keep = pruner.current_keep()
    assert pruner.keep.tolist() == [2.0] and pruner.state_dict()["keep"].numel() == 1
    assert keep.shape == (pruner.state.num_segments,) and keep.stride() == (0,)
    assert pruner.current_keep() is keep  # the same view every step: checked once
    pruner.keep = torch.tensor([2.0])  # a new buffer (as .to(device) makes): a new view
    assert pruner.current_keep() is not keep and pruner.current_keep()._base is pruner.keep
    for hard in pruner.hard_masks():  # exactly 2 of every 4
        assert torch.equal(hard.reshape(-1, 4).sum(1), torch.full((hard.numel() // 4,), 2.0))


@pytest.mark.skipif(
    "cpu" not in dtp_kernels.available_backends("cpu"), reason="dtp_kernels._C is not built"
)
def test_cpu_blocks_op_checks_shared_values_once_and_per_segment_ones_each():
    scores, offsets = torch.rand(12), torch.tensor([0, 4, 8, 12])
    log_odds, shift = torch.zeros(12), torch.zeros(3)
    op = torch.ops.dtp.transport_mask

    def run(keep, eps):
        return op(scores, offsets, keep, eps, log_odds, shift, 1, False, 0, 4)

    one_eps = torch.tensor([1.0], dtype=torch.float64).expand(3)
    with pytest.raises(RuntimeError, match=r"keep\[0\] = 4.5 is outside \[0, 4\]"):
        run(torch.tensor([4.5]).expand(3), one_eps)
    with pytest.raises(RuntimeError, match=r"keep\[2\] = -1 is outside \[0, 4\]"):
        run(torch.tensor([2.0, 2.0, -1.0]), one_eps)
    with pytest.raises(RuntimeError, match=r"eps\[0\] = inf must be finite and > 0"):
        run(
            torch.tensor([2.0]).expand(3),
            torch.tensor([float("inf")], dtype=torch.float64).expand(3),
        )
    with pytest.raises(RuntimeError, match=r"eps\[1\] = 0 must be finite and > 0"):
        run(torch.tensor([2.0]).expand(3), torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64))
    mask, *_ = run(torch.tensor([1.0]).expand(3), one_eps)
    torch.testing.assert_close(mask.view(3, 4).sum(1), torch.ones(3))


@pytest.mark.parametrize("device_backend", BACKENDS)
@pytest.mark.parametrize(
    "dtypes", [(torch.float32, torch.float64), (torch.float64, torch.float32)], ids=str
)
def test_a_shared_keep_in_another_dtype_than_the_scores(device_backend, dtypes):
    """The kernels convert a shared keep to the compute dtype as one value (and take a
    shared keep of the compute dtype as it is)."""
    device, backend = device_backend
    require_backend(backend, device)
    score_dtype, keep_dtype = dtypes
    scores = torch.rand(148, generator=torch.Generator().manual_seed(4), dtype=score_dtype)
    scores = scores.to(device)
    keep = torch.tensor([2.0], dtype=keep_dtype, device=device).expand(37)
    results = [
        transport_mask(
            scores,
            k,
            TransportState([4] * 37, dtype=score_dtype, device=device),
            eps=0.7,
            update=False,
            backend=backend,
        )
        for k in (keep, keep.contiguous())
    ]
    assert torch.equal(results[0], results[1])
