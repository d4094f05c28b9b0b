"""CompensatedSGD and CompensatedAdamW (dtp_kernels/pipeline/compensated_optim.py): a
float32 parameter is updated bitwise as torch.optim updates it; a bfloat16 or float16
one follows the float32 trajectory to within one of its spacings where torch.optim's
update rounds away, compiled (fused) and eager; chunks, strides and a state_dict round
trip change nothing; a compiler missing falls back to eager with a warning."""

from __future__ import annotations

import pytest
import torch

from dtp_kernels.pipeline import compensated_optim
from dtp_kernels.pipeline.compensated_optim import CompensatedAdamW, CompensatedSGD
from dtp_kernels.pipeline.train import make_optimizer

OPTIMIZERS = {
    "sgd": (CompensatedSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.0}),
    "sgd-momentum": (
        CompensatedSGD,
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
    ),
    "adamw": (CompensatedAdamW, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def gradients(shape: tuple[int, ...], steps: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(steps)]


def train(optimizer_class, settings, weight: torch.Tensor, grads, **extra) -> torch.Tensor:
    """`weight` (a copy of it) after one optimizer step per gradient of `grads`."""
    param = torch.nn.Parameter(weight.clone())
    optimizer = optimizer_class([param], **settings, **extra)
    for grad in grads:
        param.grad = grad.to(param.dtype)
        optimizer.step()
    return param.detach()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float32_parameters_are_updated_bitwise_as_torch_updates_them(name):
    ours, theirs, settings = OPTIMIZERS[name]
    weight, grads = torch.randn(37, 29), gradients((37, 29), 25)
    expected = train(theirs, settings, weight, grads, foreach=False)
    for chunk_size in (1 << 22, 100, 7):  # chunk edges inside rows
        got = train(ours, settings, weight, grads, chunk_size=chunk_size)
        assert torch.equal(got, expected), chunk_size


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_gradient_and_a_float32_state_are_not_written_through(name):
    """.float() of a float32 tensor is the tensor itself: the update must not change the
    caller's gradient."""
    ours, _, settings = OPTIMIZERS[name]
    param = torch.nn.Parameter(torch.randn(50))
    optimizer = ours([param], **settings)
    for grad in gradients((50,), 3):
        param.grad = grad.clone()
        optimizer.step()
        assert torch.equal(param.grad, grad)


def spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring numbers of `dtype` at each of `values`."""
    _, exponent = torch.frexp(values.float())
    epsilon = torch.full_like(values.float(), torch.finfo(dtype).eps)  # spacing at 1
    return torch.ldexp(epsilon, exponent - 1)


@pytest.mark.parametrize("state_dtype", [None, torch.float32], ids=["own-state", "fp32-state"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_low_precision_weights_follow_the_float32_trajectory(name, dtype, fused, state_dtype):
    """Every step moves a weight by less than half its spacing, steadily one way: torch's
    update rounds every step away and the weights stay where they started; the
    compensated weights end within one spacing of the float32 run, which moved them
    by several spacings, with the state in the weights' dtype or in float32."""
    ours, theirs, settings = OPTIMIZERS[name]
    # steps of at most 5e-4 in bfloat16 (SGD's momentum makes them 10x the gradient's),
    # 16x smaller in float16; the weights stay above 0.85, where half a spacing is more
    lr = {"sgd": 2.5e-4, "sgd-momentum": 2.5e-5, "adamw": 2.5e-4}[name]
    settings = {**settings, "lr": lr if dtype == torch.bfloat16 else lr / 16}
    generator = torch.Generator().manual_seed(1)
    start = (torch.rand(256, generator=generator) / 2 + 1).to(dtype)  # in [1, 1.5)
    # the same sign every step, varying size: a drift to follow
    direction = torch.randn(256, generator=generator).sign()
    grads = [(direction * (1 + torch.rand(256, generator=generator))).to(dtype) for _ in range(400)]
    exact = train(theirs, settings, start.float(), [g.float() for g in grads], foreach=False)
    plain = train(theirs, settings, start, grads, foreach=False)
    compensated = train(ours, settings, start, grads, fused=fused, state_dtype=state_dtype)
    step = spacing(exact, dtype)
    moved = (exact - start.float()).abs() / step
    assert moved.min() > 4  # the float32 run left the starting spacing far behind
    assert torch.equal(plain, start)  # every update rounded away
    error = (compensated.float() - exact).abs() / step
    assert error.max() <= 1.0, float(error.max())


def test_the_compensation_holds_what_the_weight_could_not():
    """weight + compensation is the float32 trajectory to well within one spacing."""
    ours, theirs, settings = OPTIMIZERS["sgd-momentum"]
    settings = {**settings, "lr": 1e-4}
    start = torch.linspace(0.5, 1.5, 64).bfloat16()
    grads = [g.bfloat16() for g in gradients((64,), 200, seed=2)]
    exact = train(theirs, settings, start.float(), [g.float() for g in grads], foreach=False)
    param = torch.nn.Parameter(start.clone())
    optimizer = ours([param], **settings)
    for grad in grads:
        param.grad = grad
        optimizer.step()
    compensation = optimizer.state[param]["compensation"]
    assert compensation.dtype == torch.bfloat16
    total = param.detach().float() + compensation.float()
    error = (total - exact).abs() / spacing(exact, torch.bfloat16)
    assert error.max() < 0.05, float(error.max())


@pytest.mark.parametrize("state_dtype", [None, torch.float32], ids=["bf16-state", "fp32-state"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_and_eager_updates_agree(name, state_dtype):
    """The compiled kernel computes what the eager update computes, up to rounding:
    weight + compensation agree to 2^-15 relative after 20 steps (with a float32 state
    too, whose .float() is the state itself). The compiled float32 arithmetic may round
    AdamW's step in the last place otherwise than eager (SGD's is bitwise the same), and
    the compensation, stored in bfloat16, may then round to its neighbour: 2^-16 of the
    weight apart at most (60 weights drawn: 0.94 of that at worst)."""
    ours, _, settings = OPTIMIZERS[name]
    weight = torch.randn(300, generator=torch.Generator().manual_seed(4)).bfloat16()
    grads = gradients((300,), 20, seed=5)
    results = []
    for fused in (True, False):
        param = torch.nn.Parameter(weight.clone())
        optimizer = ours([param], **settings, fused=fused, state_dtype=state_dtype)
        for grad in grads:
            param.grad = grad.bfloat16()
            optimizer.step()
        total = param.detach().float() + optimizer.state[param]["compensation"].float()
        results.append(total)
    assert torch.allclose(results[0], results[1], rtol=2**-15, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_runs_the_compiled_update_and_eager_does_not(monkeypatch, fused):
    calls, eager_calls = [], []
    update = compensated_optim.adamw_low_precision
    compiled = compensated_optim.FUSED[update]
    monkeypatch.setattr(compiled, "compiled", lambda *args: calls.append(args))
    monkeypatch.setattr(compiled, "eager", False)
    monkeypatch.setattr(
        compensated_optim,
        "adamw_low_precision",
        lambda *args: eager_calls.append(args) or update(*args),
    )
    monkeypatch.setitem(compensated_optim.FUSED, compensated_optim.adamw_low_precision, compiled)
    ours, _, settings = OPTIMIZERS["adamw"]
    weight = torch.randn(10).bfloat16()
    train(ours, settings, weight, gradients((10,), 2), fused=fused, chunk_size=3)
    # fused: the weight whole, once a step; eager: 4 chunks of at most 3 a step
    assert (len(calls), len(eager_calls)) == ((2, 0) if fused else (0, 8))
    for args in calls:  # the settings as tensors (5 tensors, then 7 settings)
        assert len(args) == 12 and all(a.dim() == 0 and a.dtype == torch.float64 for a in args[5:])
    if fused:  # the step size changed, the learning rate did not
        assert calls[0][5].item() == calls[1][5].item() == settings["lr"]
        assert calls[0][9].item() != calls[1][9].item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_new_learning_rate_compiles_nothing_more(device):
    """AdamW's step size changes every step, and here the learning rate too: the fused
    update gets them as tensors, so no step compiles it again (torch 2.11 on CUDA
    specialized them as floats, compiling every step until its limit, then failing)."""
    ours, _, settings = OPTIMIZERS["adamw"]
    params = [
        torch.nn.Parameter(torch.randn(shape).bfloat16().to(device)) for shape in [(64, 3), (50,)]
    ]
    optimizer = ours(params, **settings)
    compiled = []
    for step in range(4):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.param_groups[0]["lr"] = 0.01 / (step + 1)
        optimizer.step()
        compiled.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert compiled[0] == compiled[-1], compiled


def test_without_a_compiler_the_update_warns_once_and_runs_eager(monkeypatch):
    """torch.compile failing to build the kernel (no C++ compiler, no Triton) is a
    warning; the eager update gives the same steps as an optimizer that never tried."""

    def cannot_compile(update, *args, **kwargs):
        def fail(*_):
            raise torch._dynamo.exc.BackendCompilerFailed(
                update, RuntimeError("no C++ compiler"), None
            )

        return fail

    monkeypatch.setattr(compensated_optim.torch, "compile", cannot_compile)
    failing = compensated_optim._Fused(compensated_optim.sgd_low_precision)
    monkeypatch.setitem(compensated_optim.FUSED, compensated_optim.sgd_low_precision, failing)
    ours, _, settings = OPTIMIZERS["sgd-momentum"]
    weight, grads = torch.randn(40).bfloat16(), gradients((40,), 3, seed=6)
    with pytest.warns(RuntimeWarning, match="torch.compile failed .* run eager") as caught:
        got = train(ours, settings, weight, grads, fused=True)
    assert len(caught) == 1
    assert torch.equal(got, train(ours, settings, weight, grads, fused=False))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_chunks_and_strides_give_the_same_bits(name, fused):
    """The eager update in chunks equals it whole; the fused one ignores chunk_size; a
    channels_last weight (not contiguous) is updated whole, to the same values."""
    ours, _, settings = OPTIMIZERS[name]
    weight = torch.randn(6, 5, 3, 3).bfloat16()
    grads = gradients(weight.shape, 10, seed=3)
    whole = train(ours, settings, weight, grads, fused=fused)
    assert torch.equal(train(ours, settings, weight, grads, chunk_size=11, fused=fused), whole)
    strided = weight.contiguous(memory_format=torch.channels_last)
    param = torch.nn.Parameter(strided.clone())
    optimizer = ours([param], **settings, chunk_size=11, fused=fused)
    for grad in grads:
        param.grad = grad.bfloat16().contiguous(memory_format=torch.channels_last)
        optimizer.step()
    assert not param.is_contiguous()
    assert torch.equal(param.detach(), whole)


@torch._dynamo.config.patch(recompile_limit=1)
def test_one_run_mixing_dtypes_and_layouts_compiles_once_per_mix_past_torchs_limit():
    """One fused function updates every weight of a run: each mix of weight and momentum
    buffer dtypes (or no buffer) compiles it once, and a model's layers of every rank and memory
    format (their gradients and state laid out as they are) share that compilation;
    past torch's limit of compilations per function (set to 1 here, 8 by default) it
    still compiles, to the eager update's bits."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before, mixes = counters["stats"]["unique_graphs"], set()
    for dtype in (torch.bfloat16, torch.float16):
        for state_dtype in (None, torch.float32):
            for momentum in (0.0, 0.9):  # no momentum: no buffer, whatever its dtype
                mixes.add((dtype, momentum and (state_dtype or dtype)))
                settings = {"lr": 0.05, "momentum": momentum, "state_dtype": state_dtype}
                for shape in [(40,), (6, 5, 3, 3), (7, 3)]:
                    weight = torch.randn(shape).to(dtype)
                    if len(shape) == 4:
                        weight = weight.contiguous(memory_format=torch.channels_last)
                    got = []
                    for fused in (True, False):
                        param = torch.nn.Parameter(weight.clone())
                        optimizer = CompensatedSGD([param], **settings, fused=fused)
                        for grad in gradients(shape, 2, seed=8):
                            param.grad = torch.empty_like(param).copy_(grad)  # its layout
                            optimizer.step()
                        got.append(param.detach())
                    assert torch.equal(*got)
    assert counters["stats"]["unique_graphs"] - before == len(mixes) == 6


@pytest.mark.parametrize("state_dtype", [None, torch.float32], ids=["bf16-state", "fp32-state"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_state_dict_round_trip_continues_bitwise(name, state_dtype):
    """A float32 state comes back float32 (torch's load casts it to the parameter's
    bfloat16)."""
    ours, _, settings = OPTIMIZERS[name]
    settings = {**settings, "state_dtype": state_dtype}
    weight, grads = torch.randn(40).bfloat16(), gradients((40,), 20, seed=4)
    straight = train(ours, settings, weight, grads)
    param = torch.nn.Parameter(weight.clone())
    optimizer = ours([param], **settings)
    for grad in grads[:10]:
        param.grad = grad.bfloat16()
        optimizer.step()
    saved = optimizer.state_dict()
    param = torch.nn.Parameter(param.detach().clone())
    resumed = ours([param], **settings)
    resumed.load_state_dict(saved)
    assert resumed.state[param]["compensation"].dtype == torch.bfloat16
    for name in compensated_optim.STATE_NAMES:
        if name in resumed.state[param]:
            assert resumed.state[param][name].dtype == (state_dtype or torch.bfloat16)
    for grad in grads[10:]:
        param.grad = grad.bfloat16()
        resumed.step()
    assert torch.equal(param.detach(), straight)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: CompensatedSGD(p, lr=-1.0), r"lr = -1.0; allowed: >= 0.0"),
        (lambda p: CompensatedSGD(p, lr=0.1, momentum=1.0), r"momentum = 1.0; allowed: \[0.0"),
        (lambda p: CompensatedAdamW(p, betas=(0.9, 1.5)), r"betas\[1\] = 1.5"),
        (lambda p: CompensatedAdamW(p, eps=-1e-8), r"eps = -1e-08"),
        (lambda p: CompensatedAdamW(p, weight_decay=-0.1), r"weight_decay = -0.1"),
        (lambda p: CompensatedAdamW(p, chunk_size=0), r"chunk_size = 0; allowed: an integer"),
        (lambda p: CompensatedSGD(p, lr=0.1, fused=1), r"fused = 1; allowed: True or False"),
        (
            lambda p: CompensatedAdamW(p, state_dtype=torch.float16),
            r"state_dtype = torch.float16; allowed: None \(the parameter's dtype\)",
        ),
    ],
)
def test_bad_settings_are_refused_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make([torch.nn.Parameter(torch.zeros(3))])


def test_a_float32_second_moment_follows_its_gradients_where_a_bfloat16_one_cannot():
    """A steady drift whose gradients fall tenfold after 2,000 steps, as near an
    optimum: AdamW's bfloat16 second moment cannot fall with them (a step moves it by
    0.1% of the difference, below half its spacing), ends over twice float32 AdamW's,
    and its smaller steps leave every weight 4 or more spacings behind the float32
    run; held in float32 (state_dtype) it is the float32 run's, and the weights end
    within one spacing of that run."""
    ours, theirs, settings = OPTIMIZERS["adamw"]
    settings = {**settings, "lr": 2e-4, "weight_decay": 0.0}
    generator = torch.Generator().manual_seed(6)
    start = (torch.rand(512, generator=generator) / 2 + 1).bfloat16()
    direction = torch.randn(512, generator=generator).sign()
    grads = [
        (direction * (1 + torch.rand(512, generator=generator)) * scale).bfloat16()
        for scale in [1.0] * 2000 + [0.1] * 2000
    ]
    float32 = torch.nn.Parameter(start.float())
    reference = theirs([float32], **settings, foreach=False)
    runs = {}
    for state_dtype in (None, torch.float32):
        param = torch.nn.Parameter(start.clone())
        runs[state_dtype] = (param, ours([param], **settings, state_dtype=state_dtype))
    for grad in grads:
        float32.grad = grad.float()
        reference.step()
        for param, optimizer in runs.values():
            param.grad = grad
            optimizer.step()
    exact = reference.state[float32]["exp_avg_sq"]
    step = spacing(float32.detach(), torch.bfloat16)
    assert ((float32.detach() - start.float()).abs() / step).min() > 20  # it moved
    for state_dtype, (param, optimizer) in runs.items():
        square = optimizer.state[param]["exp_avg_sq"]
        ratio = (square.float() / exact).median()
        lag = (param.detach().float() - float32.detach()).abs() / step
        if state_dtype is None:
            assert square.dtype == torch.bfloat16 and ratio > 2 and lag.min() > 4, (ratio, lag)
        else:
            assert square.dtype == torch.float32 and abs(ratio - 1) < 1e-5, ratio
            assert lag.max() <= 1.0, lag.max()


@pytest.mark.parametrize(
    ("dtype", "optimizer", "expected"),
    [
        (torch.float32, "sgd", torch.optim.SGD),
        (torch.float32, "adamw", torch.optim.AdamW),
        (torch.bfloat16, "sgd", CompensatedSGD),
        (torch.bfloat16, "adamw", CompensatedAdamW),
    ],
)
def test_the_pipeline_compensates_low_precision_weights_only(dtype, optimizer, expected):
    model = torch.nn.Linear(4, 3).to(dtype)
    made = make_optimizer(model, {"optimizer": optimizer, "lr": 0.1})
    assert type(made) is expected
    if dtype == torch.bfloat16:  # the state in float32 unless asked otherwise
        assert made.state_dtype == torch.float32
        asked = make_optimizer(model, {"optimizer": optimizer, "lr": 0.1}, state_dtype=None)
        assert asked.state_dtype is None


@pytest.mark.cuda
@pytest.mark.parametrize("state_dtype", [None, torch.float32], ids=["own-state", "fp32-state"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_on_a_gpu_bfloat16_weights_follow_the_float32_trajectory(name, fused, state_dtype):
    """The same drift as on the CPU, on CUDA tensors (the fused update compiled by Triton):
    torch's update rounds it away, the compensated weights end within one spacing of a
    float32 run on the GPU."""
    ours, theirs, settings = OPTIMIZERS[name]
    lr = {"sgd": 2.5e-4, "sgd-momentum": 2.5e-5, "adamw": 2.5e-4}[name]
    settings = {**settings, "lr": lr}
    generator = torch.Generator().manual_seed(1)
    start = (torch.rand(4096, generator=generator) / 2 + 1).bfloat16().cuda()
    direction = torch.randn(4096, generator=generator).sign()
    grads = [
        (direction * (1 + torch.rand(4096, generator=generator))).bfloat16().cuda()
        for _ in range(400)
    ]
    exact = train(theirs, settings, start.float(), [g.float() for g in grads])
    plain = train(theirs, settings, start, grads)
    compensated = train(ours, settings, start, grads, fused=fused, state_dtype=state_dtype)
    step = spacing(exact, torch.bfloat16)
    assert ((exact - start.float()).abs() / step).min() > 4
    assert torch.equal(plain, start)
    error = (compensated.float() - exact).abs() / step
    assert error.max() <= 1.0, float(error.max())
