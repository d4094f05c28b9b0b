"""A stage's max_steps: it ends after its epochs or that many optimizer steps, whichever
come first, so a stage on a large corpus need not run a whole epoch. The last epoch run
is cut after the batch that closes the last step; the schedule spans the steps run; an
epoch's metrics line averages the batches it ran; a stop at the cut resumes bitwise."""

from __future__ import annotations

import math
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline import train as training
from dtp_kernels.pipeline.data import loaders
from dtp_kernels.pipeline.errors import RecipeError
from dtp_kernels.pipeline.preemption import Preempted
from dtp_kernels.pipeline.train import Checkpointing, MetricsLog, RunOptions, train

SETTINGS = {"epochs": 3, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def data_loaders(samples: int = 100, batch: int = 16):
    """7 batches an epoch at the defaults, the last of 4 samples."""
    x = torch.randn(samples, 6, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, x[:, :3].argmax(1))
    return loaders(data, data, batch, num_workers=0)


def counted_train(monkeypatch, settings: dict, accumulate: int = 1, every=None, **kwargs):
    """train() on the MLP, recording each step call's (lr, closes-a-step, loss);
    `every`: RunOptions.eval_every_steps."""
    calls = []
    step = training.training_step

    def counting(model, optimizer, *args, **kw):
        rate = optimizer.param_groups[0]["lr"]
        loss = step(model, optimizer, *args, **kw)
        calls.append((rate, kw.get("last", True), float(loss)))
        return loss

    monkeypatch.setattr(training, "training_step", counting)
    model, log = mlp(), MetricsLog()
    train_loader, test_loader = data_loaders()
    options = RunOptions(accumulate=accumulate, eval_every_steps=every)
    train(model, train_loader, test_loader, settings, log, "t", options=options, **kwargs)
    return model, log, calls


def test_a_stage_ends_inside_its_first_epoch_with_the_schedule_over_its_steps(monkeypatch):
    _, log, calls = counted_train(monkeypatch, {**SETTINGS, "max_steps": 4})
    assert len(calls) == 4
    cosine = [0.1 * (1 + math.cos(math.pi * t / 4)) / 2 for t in range(4)]
    assert [rate for rate, _, _ in calls] == pytest.approx(cosine)
    assert [row["epoch"] for row in log.rows] == [0]
    assert log.rows[0]["loss"] == pytest.approx(sum(c[2] for c in calls) / 4, rel=1e-6)


def test_a_stage_cut_in_its_second_epoch_logs_both(monkeypatch):
    _, log, calls = counted_train(monkeypatch, {**SETTINGS, "max_steps": 9})
    assert len(calls) == 9  # 7 batches, then 2
    assert [row["epoch"] for row in log.rows] == [0, 1]
    assert log.rows[1]["loss"] == pytest.approx((calls[7][2] + calls[8][2]) / 2, rel=1e-6)


def test_max_steps_counts_optimizer_steps_under_accumulation(monkeypatch):
    """Batches of 2 to a step: an epoch of 7 batches is 4 steps (2, 2, 2, 1); 5 steps are
    that epoch and the next one's first 2 batches."""
    _, log, calls = counted_train(monkeypatch, {**SETTINGS, "max_steps": 5}, accumulate=2)
    assert len(calls) == 9 and sum(last for _, last, _ in calls) == 5
    assert calls[-1][1]  # the run ends on a batch that closes a step
    assert [row["epoch"] for row in log.rows] == [0, 1]


@pytest.mark.parametrize("max_steps", [21, 1000])
def test_max_steps_at_or_past_the_epochs_changes_nothing(monkeypatch, max_steps):
    plain, _, _ = counted_train(monkeypatch, SETTINGS)
    capped, _, calls = counted_train(monkeypatch, {**SETTINGS, "max_steps": max_steps})
    assert len(calls) == 21
    for a, b in zip(plain.parameters(), capped.parameters(), strict=True):
        assert torch.equal(a, b)


class StopAt:
    """A preemption guard that reports SIGTERM after the `call`-th optimizer step."""

    def __init__(self, call: int) -> None:
        self.calls, self.call = 0, call

    def requested(self) -> int | None:
        self.calls += 1
        return signal.SIGTERM if self.calls == self.call else None


@pytest.mark.parametrize("stop", [9, 8], ids=["at-the-cut", "before-the-cut"])
def test_a_stop_at_or_before_the_cut_resumes_bitwise(tmp_path, stop):
    """max_steps 9: the stage stops after step 9 (the cut itself: the resumed stage runs
    no batch of that epoch) or step 8; resumed, it ends where the uninterrupted one
    ends."""
    settings = {**SETTINGS, "max_steps": 9}
    reference = mlp()
    train(reference, *data_loaders(), settings, MetricsLog(), "t")
    model, saving = mlp(), Checkpointing(tmp_path / "t.pt", {"stage": "t"})
    with pytest.raises(Preempted, match=f"epoch 1, after step {stop - 7}"):
        options = RunOptions(preemption=StopAt(stop))
        train(
            model, *data_loaders(), settings, MetricsLog(), "t", checkpoint=saving, options=options
        )
    resumed = mlp()
    saving.resume = True
    train(resumed, *data_loaders(), settings, MetricsLog(), "t", checkpoint=saving)
    assert torch.load(tmp_path / "t.pt", weights_only=True)["done"]  # a later resume returns
    for a, b in zip(reference.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_field_is_checked():
    for stage in ("pretrain", "prune", "finetune"):
        with pytest.raises(RecipeError, match=rf"{stage}.max_steps = 0"):
            recipes.load(None, [f"{stage}.max_steps=0"])
