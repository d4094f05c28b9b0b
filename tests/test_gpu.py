"""GPU suite: runs where CUDA is present (a lent H100/H200), skips cleanly elsewhere.

Triton (and, once built, CUDA) kernels against the reference in values and gradients
over the full 200-step loop, dtypes and ragged segments; bitwise-identical results across
two runs; the Triton ops under torch.compile(fullgraph=True) with inductor.
"""

import pytest
import torch
from test_transport_matches_reference import run_loop

import dtp_kernels
from conftest import RAGGED_LAYOUT
from dtp_kernels import TransportState, masked_channel_epilogue, transport_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def gpu_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [b for b in dtp_kernels.available_backends(CUDA) if b in ("triton", "cuda")]


def test_triton_is_available_and_auto_on_cuda():
    assert "triton" in dtp_kernels.available_backends(CUDA)
    assert dtp_kernels.available_backends(CUDA)[-1] in ("triton", "cuda")


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("iters", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_200_steps_match_reference_on_gpu(backend, dtype, iters):
    run_loop(backend, dtype, iters, steps=200, device=CUDA)


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_on_gpu(backend, dtype):
    tolerance = {
        torch.float16: (2e-3, 1e-3),
        torch.bfloat16: (1.6e-2, 8e-3),
        torch.float32: (2e-5, 2e-6),
    }
    rtol, atol = tolerance[dtype]
    sizes = [n for n, _ in RAGGED_LAYOUT]
    keep = [k for _, k in RAGGED_LAYOUT]
    scores = torch.rand(sum(sizes), generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = transport_mask(scores.double(), keep, TransportState(sizes), backend="reference")
    mask = transport_mask(
        scores.to(CUDA), keep, TransportState(sizes, device=CUDA), backend=backend
    )
    assert mask.dtype == dtype
    torch.testing.assert_close(mask.double().cpu(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", gpu_backends())
def test_bitwise_identical_runs(backend):
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


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "nc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_epilogue_on_gpu(backend, layout, dtype):
    gen = torch.Generator().manual_seed(4)
    shape = (8, 64, 14, 14) if layout != "nc" else (256, 96)
    y = torch.randn(shape, generator=gen).to(CUDA, dtype)
    if layout == "channels_last":
        y = y.to(memory_format=torch.channels_last)
    channel_dim = -1 if layout == "nc" else 1
    channels = y.shape[channel_dim]
    mask = torch.rand(channels, generator=gen).to(CUDA).requires_grad_(True)
    bias = torch.randn(channels, generator=gen).to(CUDA).requires_grad_(True)
    y.requires_grad_(True)
    out = masked_channel_epilogue(y, mask, bias, "relu", channel_dim, backend=backend)
    want = masked_channel_epilogue(
        y.detach().double().cpu().requires_grad_(True), mask.detach().double().cpu(),
        bias.detach().double().cpu(), "relu", channel_dim, backend="torch",
    )  # fmt: skip
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
    grad = torch.randn(shape, generator=gen).to(CUDA, dtype)
    out.backward(grad)
    first = (y.grad.clone(), mask.grad.clone(), bias.grad.clone())
    for t in (y, mask, bias):
        t.grad = None
    masked_channel_epilogue(y, mask, bias, "relu", channel_dim, backend=backend).backward(grad)
    for a, b in zip(first, (y.grad, mask.grad, bias.grad), strict=True):
        assert torch.equal(a, b)  # deterministic: two-stage sums, no atomics


@pytest.mark.parametrize("backend", gpu_backends())
def test_compile_fullgraph_on_gpu(backend):
    from test_compile import MaskedNet

    torch.manual_seed(0)
    eager = MaskedNet(backend).to(CUDA)
    compiled_model = MaskedNet(backend).to(CUDA)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(2, 3, 6, 6, device=CUDA)
    for model, fn in ((eager, eager), (compiled_model, compiled)):
        fn(x).square().sum().backward()
        model.state.commit()
    torch.testing.assert_close(compiled_model.scores.grad, eager.scores.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        compiled_model.conv.weight.grad, eager.conv.weight.grad, rtol=1e-5, atol=1e-6
    )
