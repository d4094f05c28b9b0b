"""GPU suite: runs where CUDA is present (a lent H100/H200), skips cleanly elsewhere.

Triton (and, once built, CUDA) kernels against the reference in values and gradients
over the full 200-step loop, dtypes and ragged segments; bitwise-identical results across
two runs; the Triton ops under torch.compile(fullgraph=True) with inductor.
"""

import pytest
import torch

import dtp_kernels
from dtp_kernels import TransportState, masked_channel_epilogue, transport_mask
from utils import RAGGED_LAYOUT, check_low_precision, run_loop

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


@pytest.mark.parametrize("blocks", [2, 7])
@pytest.mark.parametrize("iters", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_schedule_matches_reference(blocks, dtype, iters):
    """CUDA's several-blocks-per-segment schedule, forced on the ragged layout."""
    if "cuda" not in gpu_backends():
        pytest.skip("the CUDA kernels are not built")
    run_loop("cuda", dtype, iters, steps=50, device=CUDA, blocks_per_segment=blocks)


@pytest.mark.parametrize("iters", [1, 3])
def test_large_segments_take_split_schedule_and_match(iters):
    """Above 65536 elements CUDA splits segments; it agrees with the fused schedule."""
    if "cuda" not in gpu_backends():
        pytest.skip("the CUDA kernels are not built")
    sizes, keep = [300_000, 3, 90_001, 1], [1000.5, 1.5, 45_000.0, 1.0]
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(2)).to(CUDA)
    weights = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(3)).to(CUDA)
    out = {}
    for blocks in (0, 1):  # 0 = the size-based choice (split here), 1 = fused
        s = scores.clone().requires_grad_(True)
        k = torch.tensor(keep, device=CUDA, requires_grad=True)
        state = TransportState(sizes, device=CUDA)
        mask = transport_mask(s, k, state, iters=iters, backend="cuda", blocks_per_segment=blocks)
        (weights * mask).sum().backward()
        out[blocks] = (mask.detach(), s.grad, k.grad, state.pending_log_odds, state.pending_shift)
    ref_state = TransportState(sizes, dtype=torch.float64)
    s = scores.double().cpu().requires_grad_(True)
    mask = transport_mask(s, keep, ref_state, iters=iters, backend="reference")
    for a, b in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(out[0][0].double().cpu(), mask.detach(), rtol=2e-5, atol=1e-6)
    assert torch.allclose(out[0][0].sum(0).double().cpu(), torch.tensor(sum(keep)).double())


# 0 = each backend's own schedule; 3 = CUDA's split schedule (Triton has none)
SCHEDULES = [(b, 0) for b in gpu_backends()] + [(b, 3) for b in gpu_backends() if b == "cuda"]


@pytest.mark.parametrize("backend,blocks", SCHEDULES)
@pytest.mark.parametrize("mode", ["neutral", "propagate"])
def test_nonfinite_scores_on_gpu(backend, blocks, mode):
    """NaN/Inf scores: the GPU kernels (CUDA's fused and split schedules) give the eager
    backend's mask, gradients, held state and per-segment flags."""
    sizes, keep = [4, 600, 5, 1], [2.0, 300.5, 1.5, 1.0]
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(sum(sizes), generator=gen)
    weights = torch.randn(sum(sizes), generator=gen)
    scores[5], scores[606] = float("nan"), float("inf")  # segments 1 and 2
    out = {}
    for device, name in ((CUDA, backend), (torch.device("cpu"), "torch")):
        state = TransportState(sizes, device=device)
        s = scores.to(device).requires_grad_(True)
        schedule = {"blocks_per_segment": blocks} if name == "cuda" else {}
        mask = transport_mask(s, keep, state, backend=name, nonfinite=mode, **schedule)
        (weights.to(device) * mask.nan_to_num(0.0)).sum().backward()
        state.commit()
        out[name] = [t.detach().cpu() for t in (mask, s.grad, state.log_odds, state.shift)]
        assert state.skipped_steps.tolist() == [0, 1, 1, 0]
    if mode == "propagate":  # gradients through a NaN segment are NaN in no fixed pattern
        del out[backend][1], out["torch"][1]
    for a, b in zip(out[backend], out["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    if mode == "neutral":
        assert torch.isfinite(out[backend][0]).all() and out[backend][1][[5, 606]].eq(0).all()


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_on_gpu(backend, dtype):
    check_low_precision(backend, dtype, device=CUDA)


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
        y.detach().double().cpu().requires_grad_(True),
        mask.detach().double().cpu(),
        bias.detach().double().cpu(),
        "relu",
        channel_dim,
        backend="torch",
    )
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


def test_cuda_matches_triton():
    if not {"cuda", "triton"} <= set(gpu_backends()):
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


SANITIZED = """
import torch, dtp_kernels as d
c = torch.device("cuda")
st = d.TransportState([1, 3, 1025, 70000], device=c)
s = torch.randn(71029, device=c, requires_grad=True)
for iters in (1, 3):
    m = d.transport_mask(s, [1.0, 1.5, 10.0, 3000.0], st, iters=iters, backend="cuda")
    m.square().sum().backward()
for fmt in (torch.contiguous_format, torch.channels_last):
    y = torch.randn(3, 5, 7, 9, device=c).to(memory_format=fmt).requires_grad_(True)
    mask = torch.rand(5, device=c, requires_grad=True)
    bias = torch.randn(5, device=c)
    d.masked_channel_epilogue(y, mask, bias, "relu", backend="cuda").sum().backward()
torch.cuda.synchronize()
"""


def test_compute_sanitizer_memcheck_clean():
    """compute-sanitizer memcheck on one run of each CUDA kernel."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if "cuda" not in gpu_backends():
        pytest.skip("the CUDA kernels are not built")
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(tool).exists():
        pytest.skip("compute-sanitizer not found")
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [tool, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", SANITIZED],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout + result.stderr


def test_opcheck_cuda_kernels():
    if "cuda" not in gpu_backends():
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


def dtp_training_setup(
    backend: str, mask_at: str = "parameters", budget: str = "layer", channels_last=False
):
    """resnet20 with DTP masks on the GPU, its optimizer (state committed after each step)
    and one batch."""
    from dtp_kernels import DTPPruner
    from dtp_kernels.models import resnet20
    from dtp_kernels.pipeline.train import make_optimizer

    torch.manual_seed(0)
    model = resnet20().to(CUDA)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(16, 3, 32, 32, generator=gen).to(CUDA)
    labels = torch.randint(0, 10, (16,), generator=gen).to(CUDA)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        images = images.to(memory_format=torch.channels_last)
    epilogue = backend if backend in ("cuda", "triton", "torch") else "auto"
    pruner = DTPPruner(
        model,
        images[:1],
        0.5,
        budget=budget,
        mask_at=mask_at,
        backend=backend,
        epilogue_backend=epilogue,
    )
    optimizer = make_optimizer(model, {"lr": 0.05}, pruner)
    pruner.attach(optimizer)
    return model, pruner, optimizer, images, labels


@pytest.mark.parametrize("budget", ["layer", "flops"])
@pytest.mark.parametrize("mask_at", ["parameters", "activation"])
@pytest.mark.parametrize("backend", [*gpu_backends(), "torch"])
def test_training_step_has_no_host_sync(backend, mask_at, budget):
    from dtp_kernels.pipeline.step import training_step

    model, pruner, optimizer, images, labels = dtp_training_setup(backend, mask_at, budget)
    target = 0.5 if budget == "flops" else None
    for _ in range(2):  # warm-up: per-state caches, Triton compilation
        training_step(model, optimizer, images, labels, pruner, target)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            training_step(model, optimizer, images, labels, pruner, target)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(pruner.state.steps) == 4


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-channels-last"])
@pytest.mark.parametrize("backend", gpu_backends())
def test_training_step_in_cuda_graph_matches_eager(backend, amp):
    """A whole DTP training step (forward, backward, SGD step, state commit) captured in a
    CUDA graph and replayed gives what the same steps give eagerly; also under bf16
    autocast with channels_last (the GPU benchmark's setting)."""
    from dtp_kernels.pipeline.step import training_step

    runs = {}
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    for mode in ("eager", "graph"):
        model, pruner, optimizer, images, labels = dtp_training_setup(
            backend, channels_last=amp is not None
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
            for _ in range(3):
                training_step(model, optimizer, images, labels, pruner, amp=amp)
        torch.cuda.current_stream().wait_stream(side)
        if mode == "graph":
            graph = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                training_step(model, optimizer, images, labels, pruner, amp=amp)
            for _ in range(5):
                graph.replay()
        else:
            for _ in range(5):
                training_step(model, optimizer, images, labels, pruner, amp=amp)
        torch.cuda.synchronize()
        runs[mode] = (
            pruner.scores.detach().clone(),
            pruner.state.log_odds.clone(),
            pruner.state.shift.clone(),
            pruner.state.steps.clone(),
            torch.cat([p.detach().flatten() for p in model.parameters()]),
        )
    for a, b in zip(runs["eager"], runs["graph"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert int(runs["graph"][3]) == 8
