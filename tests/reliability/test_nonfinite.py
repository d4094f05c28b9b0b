"""Non-finite scores or gradients in one group mid-training (issue 8): that group's
state is held on the device, the skipped steps are counted per group and reported, a
warning comes at most once per check interval, the other groups keep training, and the
group trains again once its values are finite."""

from __future__ import annotations

import warnings

import pytest
import torch

from dtp_kernels import DTPPruner, TransportState, transport_mask
from dtp_kernels.models import digits_cnn
from dtp_kernels.pipeline.step import training_step
from dtp_kernels.pipeline.train import make_optimizer


def setup(backend: str, budget: str = "layer"):
    torch.manual_seed(0)
    model = digits_cnn()
    gen = torch.Generator().manual_seed(1)
    images, labels = torch.randn(32, 1, 8, 8, generator=gen), torch.randint(0, 10, (32,))
    pruner = DTPPruner(model, images[:1], 0.5, budget=budget, backend=backend)
    optimizer = make_optimizer(model, {"lr": 0.05}, pruner)
    pruner.attach(optimizer)
    return model, pruner, optimizer, images, labels


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bad_scores_hold_one_group_while_the_others_train(backend, bad):
    model, pruner, optimizer, images, labels = setup(backend)
    assert len(pruner.sizes) >= 2
    a, b = int(pruner.state.offsets[1]), int(pruner.state.offsets[2])  # group 1
    for _ in range(3):
        training_step(model, optimizer, images, labels, pruner)
    healthy = pruner.scores.detach()[a:b].clone()
    for _ in range(4):
        with torch.no_grad():
            pruner.scores[a + 1] = bad
        before = pruner.state.log_odds.clone()
        loss = training_step(model, optimizer, images, labels, pruner)
        after = pruner.state.log_odds
        assert torch.isfinite(loss)
        assert torch.equal(after[a:b], before[a:b])  # held
        assert not torch.equal(after[:a], before[:a])  # the others moved
        assert not torch.equal(after[b:], before[b:])
        assert torch.isfinite(after).all()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    skipped = pruner.skipped_steps()
    assert skipped[1] == 4 and sum(skipped) == 4
    assert [row["skipped_steps"] for row in pruner.report()["groups"]] == skipped
    with torch.no_grad():  # finite again: the group trains again
        pruner.scores[a:b] = healthy
    before = pruner.state.log_odds.clone()
    training_step(model, optimizer, images, labels, pruner)
    assert not torch.equal(pruner.state.log_odds[a:b], before[a:b])
    assert pruner.skipped_steps()[1] == 4
    assert int(pruner.state.steps) == 8


def test_inf_gradients_are_skipped_the_same_way():
    """An Inf gradient makes a score Inf/NaN after the optimizer step; the next step holds
    that group."""
    model, pruner, optimizer, images, labels = setup("cpu")
    a = int(pruner.state.offsets[2])
    poison = {"on": True}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if poison["on"]:
            grad = grad.clone()
            grad[a] = float("inf")
        return grad

    handle = pruner.scores.register_hook(hook)
    training_step(model, optimizer, images, labels, pruner)  # scores[a] becomes -inf
    poison["on"] = False
    handle.remove()
    assert not torch.isfinite(pruner.scores[a])
    training_step(model, optimizer, images, labels, pruner)
    assert pruner.skipped_steps()[2] == 1 and sum(pruner.skipped_steps()) == 1


@pytest.mark.slow
def test_warning_at_most_once_per_check_interval():
    model, pruner, optimizer, images, labels = setup("cpu", budget="global")
    assert DTPPruner.NONFINITE_CHECK_EVERY == 100
    with torch.no_grad():
        pruner.scores[0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(250):
            training_step(model, optimizer, images, labels, pruner)
    messages = [w for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 2  # checks at steps 100 and 200
    assert "all groups (global)" in str(messages[0].message)
    assert pruner.skipped_steps() == [250] * len(pruner.groups)
    with torch.no_grad():
        pruner.scores[0] = 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(150):  # check at step 300: 50 more skipped, then none
            training_step(model, optimizer, images, labels, pruner)
    assert len([w for w in caught if "non-finite" in str(w.message)]) == 1


def test_hold_keeps_the_marked_segments_and_counts_them():
    state = TransportState([3, 4, 2])
    scores = torch.tensor([0.1, 0.7, 0.3, 0.2, 0.5, 0.9, 0.1, 0.4, 0.8])
    transport_mask(scores, [1.0, 2.0, 1.0], state, backend="torch")
    state.hold(torch.tensor([True, False, True]))
    state.commit()
    assert state.skipped_steps.tolist() == [1, 0, 1] and int(state.steps) == 1
    assert torch.equal(state.log_odds[:3], torch.zeros(3))
    assert torch.equal(state.log_odds[7:], torch.zeros(2))
    assert not torch.equal(state.log_odds[3:7], torch.zeros(4))
    state.commit()  # no pending step: nothing counted
    assert state.skipped_steps.tolist() == [1, 0, 1]


def test_report_and_export_stay_finite_with_bad_scores():
    _model, pruner, _optimizer, images, _labels = setup("cpu")
    with torch.no_grad():
        pruner.scores[0] = float("nan")
        pruner.scores[1] = float("inf")
    assert torch.isfinite(pruner.channel_scores()).all()
    report = pruner.report()
    assert all(row["k"] == k for row, k in zip(report["groups"], pruner.kept, strict=True))
    exported = pruner.export()
    assert torch.isfinite(exported(images)).all()
