"""run.eval_every_steps: an evaluation within an epoch every that many optimizer steps,
a metrics line with its "step"; it changes nothing of the training, a stop after it
resumes with the same lines, and TensorBoard plots it against the step."""

from __future__ import annotations

import pytest
import torch
from test_max_steps import SETTINGS, StopAt, counted_train, data_loaders, mlp

from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline.errors import RecipeError
from dtp_kernels.pipeline.preemption import Preempted
from dtp_kernels.pipeline.train import Checkpointing, MetricsLog, RunOptions, evaluate, train

TWO_EPOCHS = {**SETTINGS, "epochs": 2}  # 7 batches an epoch


def test_evaluations_every_3_steps_between_the_epochs_lines(monkeypatch):
    plain, plain_log, _ = counted_train(monkeypatch, TWO_EPOCHS)
    model, log, calls = counted_train(monkeypatch, TWO_EPOCHS, every=3)
    assert [(r["epoch"], r.get("step")) for r in log.rows] == [
        (0, 3), (0, 6), (0, None), (1, 9), (1, 12), (1, None)
    ]  # fmt: skip
    assert log.rows[1]["loss"] == pytest.approx(sum(c[2] for c in calls[:6]) / 6, rel=1e-6)
    assert log.rows[3]["loss"] == pytest.approx(sum(c[2] for c in calls[7:9]) / 2, rel=1e-6)
    epochs = [r for r in log.rows if "step" not in r]
    assert epochs == plain_log.rows  # the epochs' lines as without it
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)  # nothing of the training changed
    assert log.rows[-1]["accuracy"] == evaluate(model, data_loaders()[1])


def test_steps_are_optimizer_steps_under_accumulation(monkeypatch):
    """4 optimizer steps an epoch (batches 2, 2, 2, 1): every 3 steps is step 3 in the
    first epoch and step 6 in the second."""
    _, log, _ = counted_train(monkeypatch, TWO_EPOCHS, accumulate=2, every=3)
    assert [(r["epoch"], r.get("step")) for r in log.rows] == [(0, 3), (0, None), (1, 6), (1, None)]


def test_a_stop_after_an_evaluation_resumes_with_the_same_lines(tmp_path):
    every = RunOptions(eval_every_steps=3)
    reference = MetricsLog()
    train(mlp(), *data_loaders(), TWO_EPOCHS, reference, "t", options=every)
    saving, log = Checkpointing(tmp_path / "t.pt", {"stage": "t"}), MetricsLog()
    stop = RunOptions(eval_every_steps=3, preemption=StopAt(9))
    with pytest.raises(Preempted, match="epoch 1, after step 2"):
        train(mlp(), *data_loaders(), TWO_EPOCHS, log, "t", checkpoint=saving, options=stop)
    saving.resume, resumed = True, MetricsLog()
    train(mlp(), *data_loaders(), TWO_EPOCHS, resumed, "t", checkpoint=saving, options=every)
    assert resumed.rows == reference.rows


def test_tensorboard_plots_them_against_the_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tensorboard_dir=tmp_path)
    log.write(stage="dtp", epoch=0, step=5, loss=1.0, accuracy=0.5)
    log.write(stage="dtp", epoch=0, loss=0.5, accuracy=0.75)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"dtp/steps/loss", "dtp/steps/accuracy", "dtp/loss", "dtp/accuracy"}
    assert [(e.step, e.value) for e in events.Scalars("dtp/steps/accuracy")] == [(5, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("dtp/accuracy")] == [(0, 0.75)]


def test_the_field_is_checked():
    with pytest.raises(RecipeError, match=r"run.eval_every_steps = 0"):
        recipes.load(None, ["run.eval_every_steps=0"])
