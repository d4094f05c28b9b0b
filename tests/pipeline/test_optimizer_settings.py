"""A stage's optimizer settings beyond the learning rate: `warmup_steps` (a linear
warm-up multiplying the schedule) and `max_grad_norm` (the model's gradients clipped to
a total norm, after unscaling under fp16's GradScaler); a run resumed in the warm-up
ends bitwise where an uninterrupted one ends."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline.errors import RecipeError
from dtp_kernels.pipeline.step import training_step
from dtp_kernels.pipeline.train import make_schedule


def learning_rates(settings: dict, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = make_schedule(optimizer, settings, steps)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_the_warm_up_multiplies_the_schedule(schedule):
    settings = {"schedule": schedule, "epochs": 4, "milestones": [1, 3], "gamma": 0.1}
    plain = learning_rates(settings, 20)
    warmed = learning_rates({**settings, "warmup_steps": 4}, 20)
    ramp = [(1 + min(t, 4) * 4 / 4) / 5 for t in range(20)]  # 1/5, 2/5, ... 1 from step 4
    assert warmed == pytest.approx([r * p for r, p in zip(ramp, plain, strict=True)], rel=1e-9)
    if schedule == "cosine":
        assert plain == pytest.approx([(1 + math.cos(math.pi * t / 20)) / 2 for t in range(20)])
    else:  # x0.1 after epoch 1 and 3, 5 steps an epoch
        assert plain == pytest.approx([1.0] * 5 + [0.1] * 10 + [0.01] * 5)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad-scaler"])
def test_clipping_scales_the_gradients_to_the_norm_before_the_step(scaled):
    x, y = torch.randn(16, 6) * 10, torch.randint(0, 3, (16,))
    model, reference = mlp(), mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    training_step(model, optimizer, x, y, scaler=scaler, clip=(list(model.parameters()), 0.01))
    # by hand: the gradient of the loss, scaled to a total norm of 0.01, one SGD step
    nn.functional.cross_entropy(reference(x), y).backward()
    grads = [p.grad for p in reference.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 0.01  # the clip does act
    with torch.no_grad():
        for p, g in zip(reference.parameters(), grads, strict=True):
            p -= 0.1 * g * (0.01 / (norm + 1e-6))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_stage_clips_with_its_max_grad_norm():
    """train() passes the stage's max_grad_norm to every step: at 1e-9 no step moves a
    weight by more than lr x 1e-9."""
    from torch.utils.data import TensorDataset

    from dtp_kernels.pipeline.data import loaders
    from dtp_kernels.pipeline.train import MetricsLog, train

    x = torch.randn(64, 6)
    data = TensorDataset(x, x[:, :3].argmax(1))
    train_loader, test_loader = loaders(data, data, 16, num_workers=0)
    settings = {"epochs": 1, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    moved = {}
    for norm in (None, 1e-9):
        model = mlp()
        start = [p.detach().clone() for p in model.parameters()]
        train(
            model, train_loader, test_loader, {**settings, "max_grad_norm": norm}, MetricsLog(), "t"
        )
        moved[norm] = max(
            float((p - s).abs().max()) for p, s in zip(model.parameters(), start, strict=True)
        )
    assert moved[None] > 1e-3 and moved[1e-9] <= 4 * 0.1 * 1e-9 * 1.01


def test_the_fields_are_checked():
    with pytest.raises(RecipeError, match=r"prune.max_grad_norm"):
        recipes.load(None, ["prune.max_grad_norm=0"])
    with pytest.raises(RecipeError, match=r"finetune.warmup_steps"):
        recipes.load(None, ["finetune.warmup_steps=-1"])


@pytest.mark.slow
def test_a_crash_in_the_warm_up_resumes_bitwise(tmp_path, monkeypatch):
    from dtp_kernels.pipeline import train as training
    from dtp_kernels.pipeline.run import run
    from utils import DIGITS_RECIPE, final_state, lose_the_node_at

    overrides = [
        "pretrain.epochs=1",
        "prune.epochs=2",
        "finetune.epochs=1",
        "prune.warmup_steps=30",
        "prune.max_grad_norm=1.0",
        "run.checkpoint_steps=5",
        "run.plots=false",
    ]
    recipe = recipes.load(DIGITS_RECIPE, overrides)
    recipe["run"]["progress"] = False
    run(copy.deepcopy(recipe), tmp_path / "reference")
    out = tmp_path / "crashed"
    # batch 52: the DTP stage's step 29 (22 batches an epoch), inside its warm-up
    monkeypatch.setattr(training, "training_step", lose_the_node_at(52, training.training_step))
    with pytest.raises(RuntimeError, match="node lost"):
        run(copy.deepcopy(recipe), out)
    monkeypatch.undo()
    run(recipe, out, resume=True)
    want, got = final_state(tmp_path / "reference"), final_state(out)
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs"


def test_a_flops_target_without_its_pruner_is_an_error_before_the_step():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    x, y = torch.randn(3, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="flops_target needs the pruner"):
        training_step(model, optimizer, x, y, flops_target=0.5)
    assert torch.equal(model.weight, before)
