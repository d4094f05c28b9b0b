"""masked_channel_epilogue against a float64 reference: values, gradients, layouts, dtypes."""

import pytest
import torch

import dtp_kernels
from dtp_kernels import masked_channel_epilogue
from utils import CUDA, cuda_backends

BACKENDS = [b for b in dtp_kernels.available_backends("cpu") if b != "reference"]
COMPILED = "cpu" in BACKENDS
# (rtol, atol) of a backend in this dtype against the float64 reference.
TOLERANCES = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def reference(y, mask, bias, activation, channel_dim):
    """The op's definition, literally, in float64."""
    shape = [1] * y.dim()
    shape[channel_dim] = -1
    out = y.double()
    if bias is not None:
        out = out + bias.double().view(shape)
    out = out * mask.double().view(shape)
    return torch.relu(out) if activation == "relu" else out


def make_y(layout, dtype, gen):
    shapes = {
        "nchw": (3, 5, 7, 9),
        "channels_last": (3, 5, 7, 9),
        "nc": (11, 13),
        "ncl": (2, 6, 1025),
        "transposed": (4, 6, 5, 3),
        "c1": (2, 1, 4, 4),
        "hw1": (5, 7, 1, 1),
        "n1_c3_1023": (1, 3, 1023),
        "rows_c1025": (130, 1025),
    }
    y = torch.randn(shapes[layout], generator=gen).to(dtype)
    if layout == "channels_last":
        y = y.to(memory_format=torch.channels_last)
    if layout == "transposed":
        y = y.transpose(2, 3)  # neither contiguous nor channels_last
    channel_dim = -1 if layout in ("nc", "rows_c1025") else 1
    return y, channel_dim


LAYOUTS = [
    "nchw",
    "channels_last",
    "nc",
    "ncl",
    "transposed",
    "c1",
    "hw1",
    "n1_c3_1023",
    "rows_c1025",
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_reference(backend, layout, dtype, activation, with_bias):
    gen = torch.Generator().manual_seed(0)
    y, channel_dim = make_y(layout, dtype, gen)
    channels = y.shape[channel_dim]
    mask = (torch.rand(channels, generator=gen) * 1.5).requires_grad_(True)
    bias = torch.randn(channels, generator=gen).requires_grad_(True) if with_bias else None
    y.requires_grad_(True)
    out = masked_channel_epilogue(y, mask, bias, activation, channel_dim, backend=backend)
    assert out.dtype == y.dtype and out.shape == y.shape
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)
    yr = y.detach().double().requires_grad_(True)
    mr = mask.detach().double().requires_grad_(True)
    br = bias.detach().double().requires_grad_(True) if with_bias else None
    want = reference(yr, mr, br, activation, channel_dim % y.dim())
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)

    grad = torch.randn(y.shape, generator=gen).to(dtype)
    out.backward(grad)
    want.backward(grad.double())
    torch.testing.assert_close(y.grad.double(), yr.grad, rtol=rtol, atol=atol)
    # mask and bias are float32, so are their gradients; each is a sum over many elements,
    # and the input rounding of dtype enters every term
    rtol, atol = max(rtol, TOLERANCES[torch.float32][0]), max(atol, TOLERANCES[torch.float32][1])
    scale = max(1.0, y.numel() / channels) ** 0.5
    torch.testing.assert_close(mask.grad.double(), mr.grad, rtol=rtol * scale, atol=atol * scale)
    if with_bias:
        torch.testing.assert_close(
            bias.grad.double(), br.grad, rtol=rtol * scale, atol=atol * scale
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "nc"])
def test_gradcheck_float64(backend, activation, layout):
    gen = torch.Generator().manual_seed(1)
    y, channel_dim = make_y(layout, torch.float64, gen)
    # small: gradcheck runs the op twice per input element (interpreted Triton: ~ms each)
    y = y[:2, :5] if y.dim() == 2 else y[:2, :3, :2, :3]
    if layout == "channels_last":
        y = y.contiguous(memory_format=torch.channels_last)
    y = y.detach().requires_grad_(True)
    channels = y.shape[channel_dim]
    mask = torch.rand(channels, generator=gen, dtype=torch.float64).requires_grad_(True)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64).requires_grad_(True)

    def fn(y, mask, bias):
        return masked_channel_epilogue(y, mask, bias, activation, channel_dim, backend=backend)

    assert torch.autograd.gradcheck(fn, (y, mask, bias), eps=1e-6, atol=1e-6)


@pytest.mark.skipif(not COMPILED, reason="dtp_kernels._C is not built")
@pytest.mark.parametrize(
    "with_bias,needs",
    [
        (with_bias, needs)
        for with_bias in (True, False)
        for needs in [("y",), ("mask",), ("bias",), ("y", "mask"), ("y", "mask", "bias")]
        if with_bias or "bias" not in needs
    ],
)
def test_cpu_node_gives_the_gradients_asked_for(with_bias, needs):
    """The C++ backward node: gradients of exactly the inputs that require grad, equal to
    the reference's; a second backward raises (its saved tensors are freed)."""
    gen = torch.Generator().manual_seed(3)
    y, _ = make_y("nchw", torch.float64, gen)
    inputs = {
        "y": y,
        "mask": torch.rand(5, generator=gen, dtype=torch.float64),
        "bias": torch.randn(5, generator=gen, dtype=torch.float64) if with_bias else None,
    }
    for name, t in inputs.items():
        if t is not None:
            t.requires_grad_(name in needs)
    out = masked_channel_epilogue(*inputs.values(), "relu", 1, backend="cpu")
    assert out.grad_fn.name() == "dtp::MaskedChannelEpilogueBackward"
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    wanted = [inputs[name] for name in needs]
    got = torch.autograd.grad(out, wanted, g)
    leaves = {
        k: (t.detach().requires_grad_(True) if t is not None else None) for k, t in inputs.items()
    }
    expected = torch.autograd.grad(
        reference(*leaves.values(), "relu", 1), [leaves[name] for name in needs], g
    )
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out, wanted, g)


@pytest.mark.skipif(not COMPILED, reason="dtp_kernels._C is not built")
def test_cpu_node_refuses_forward_mode_ad():
    import torch.autograd.forward_ad as forward_ad

    y = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.rand(3, dtype=torch.float64), torch.ones(3))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            masked_channel_epilogue(y, dual, None, "relu", 1, backend="cpu")


@pytest.mark.skipif(not COMPILED, reason="dtp_kernels._C is not built")
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "rows_c1025"])
def test_backward_is_deterministic_across_threads(layout):
    gen = torch.Generator().manual_seed(2)
    y, channel_dim = make_y(layout, torch.float32, gen)
    y = torch.cat([y] * 8).requires_grad_(True)  # enough work to be split across threads
    channels = y.shape[channel_dim]
    mask = torch.rand(channels, generator=gen, requires_grad=True)
    bias = torch.randn(channels, generator=gen, requires_grad=True)
    grad = torch.randn(y.shape, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, threads, 1, threads):
            torch.set_num_threads(n)
            for t in (y, mask, bias):
                t.grad = None
            out = masked_channel_epilogue(y, mask, bias, "relu", channel_dim, backend="cpu")
            out.backward(grad)
            results.append((out.detach(), y.grad.clone(), mask.grad.clone(), bias.grad.clone()))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(not COMPILED, reason="dtp_kernels._C is not built")
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(with_bias, dtype):
    y = torch.randn(2, 4, 3, 3, dtype=dtype, requires_grad=True)
    mask = torch.rand(4, requires_grad=True)
    bias = torch.randn(4, requires_grad=True) if with_bias else None
    torch.library.opcheck(torch.ops.dtp.masked_channel_epilogue.default, (y, mask, bias, "relu", 1))
    grad = torch.randn(2, 4, 3, 3, dtype=dtype)
    torch.library.opcheck(
        torch.ops.dtp.masked_channel_epilogue_backward.default,
        (grad, y.detach(), mask.detach(), None if bias is None else bias.detach(), "none", 1),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_returns_input_dtype(backend):
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(2, 4, 5, 5, generator=gen)
    mask, bias = torch.rand(4, generator=gen), torch.randn(4, generator=gen)
    want = reference(y, mask, bias, "relu", 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out32 = masked_channel_epilogue(y, mask, bias, "relu", backend=backend)
        out16 = masked_channel_epilogue(y.bfloat16(), mask, bias, "relu", backend=backend)
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16
    torch.testing.assert_close(out32.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out16.double(), want, rtol=1.6e-2, atol=3e-2)


BAD = [
    (dict(y=torch.arange(8.0)), ValueError, r"y must have at least 2 dims"),
    (dict(y=torch.ones(2, 4, dtype=torch.int32)), TypeError, r"y must be a float16"),
    (dict(channel_dim=4), ValueError, r"channel_dim = 4 is outside \[-4, 3\] for a 4-D y"),
    (dict(mask=torch.rand(5)), ValueError, r"mask has shape \(5,\); y has 4 channels on dim 1"),
    (dict(mask=torch.ones(4, dtype=torch.int64)), TypeError, r"mask must be a floating-point"),
    (dict(bias=torch.rand(3)), ValueError, r"bias has shape \(3,\); y has 4 channels"),
    (dict(activation="gelu"), ValueError, r"activation = 'gelu'; allowed: \[None, 'relu'\]"),
    (dict(backend="reference"), ValueError, r"backend = 'reference'; allowed"),
]


@pytest.mark.parametrize("kwargs,error,pattern", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input(kwargs, error, pattern):
    args = dict(y=torch.randn(2, 4, 3, 3), mask=torch.rand(4), bias=None, activation=None)
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        masked_channel_epilogue(**args)


@pytest.mark.parametrize("backend", cuda_backends())
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "nc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.cuda
def test_epilogue_on_cuda_matches_float64_and_is_deterministic(backend, layout, dtype):
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
