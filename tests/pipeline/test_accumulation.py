"""Gradient accumulation (data.accumulate): k batches of b samples make one optimizer step
equal to one step on a batch of k x b, DTP's scores and transport state included (the
masks only change at the commit after the optimizer step); the schedule counts
optimizer steps; checkpoints fall between optimizer steps and resume bitwise; under DDP
only an optimizer step's last batch all-reduces."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import free_port
from torch import nn
from torch.utils.data import TensorDataset

from dtp_kernels import DTPPruner
from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline.data import loaders
from dtp_kernels.pipeline.errors import RecipeError, UsageError
from dtp_kernels.pipeline.train import MetricsLog, RunOptions, accumulation_plan, train

SAMPLES, FEATURES, CLASSES = 256, 12, 5
SETTINGS = {"epochs": 2, "lr": 0.2, "momentum": 0.9, "weight_decay": 5e-4, "schedule": "cosine"}


def mlp() -> nn.Module:
    """No BatchNorm, no dropout: a step's gradient depends only on its samples."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, CLASSES)
    )


def data(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, :CLASSES] * 3).argmax(1))


def trained(batch: int, accumulate: int, samples: int = SAMPLES, **settings) -> tuple:
    """Parameters and pruner state after DTP training with batches of `batch` samples,
    `accumulate` of them per optimizer step."""
    model = mlp()
    train_loader, test_loader = loaders(data(samples), data(64), batch, num_workers=0)
    pruner = DTPPruner(model, torch.zeros(1, FEATURES), 0.5, eps=0.5)
    options = RunOptions(accumulate=accumulate)
    train(
        model,
        train_loader,
        test_loader,
        {**SETTINGS, **settings},
        MetricsLog(),
        "dtp",
        pruner,
        options=options,
    )
    return [p.detach().clone() for p in model.parameters()], pruner.state_dict()


def test_the_plan_weights_batches_by_their_samples_and_closes_each_step():
    # 10 samples in batches of 3: 3, 3, 3, 1; steps of two batches: (3, 3), (3, 1)
    assert accumulation_plan(10, 3, 2) == [
        (0.5, True, False),
        (0.5, False, True),
        (0.75, True, False),
        (0.25, False, True),
    ]
    assert accumulation_plan(10, 3, 1) == [(1.0, True, True)] * 4
    assert accumulation_plan(10, 3, 4) == [
        (0.3, True, False),
        (0.3, False, False),
        (0.3, False, False),
        (0.1, False, True),
    ]


@pytest.mark.parametrize(
    ("samples", "schedule"), [(SAMPLES, "cosine"), (SAMPLES - 24, "step")], ids=["even", "ragged"]
)
def test_accumulated_batches_train_like_one_batch_of_all_their_samples(samples, schedule):
    # ragged: 232 samples, so the epoch's last step is 1 batch of 8 (accumulated) and
    # 1 batch of 40 (whole); the step schedule's milestone falls after epoch 1
    extra = {"schedule": schedule, "milestones": [1], "gamma": 0.1}
    want_params, want_state = trained(64, 1, samples, **extra)
    got_params, got_state = trained(32, 2, samples, **extra)
    for want, got in zip(want_params, got_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert want_state.keys() == got_state.keys()
    for key in want_state:
        torch.testing.assert_close(got_state[key], want_state[key], rtol=1e-4, atol=1e-5)
    assert int(got_state["state.steps"]) == 2 * -(-samples // 64)  # one commit per step
    # the control: the same batches of 32 stepped one by one train differently
    single_params, _ = trained(32, 1, samples, **extra)
    assert not torch.allclose(single_params[0], want_params[0], rtol=1e-3, atol=1e-4)


def test_accumulate_is_checked_before_training():
    with pytest.raises(RecipeError, match=r"data\.accumulate"):
        recipes.load(None, ["data.accumulate=0"])
    with pytest.raises(UsageError, match=r"data.accumulate = 0; allowed: an integer >= 1"):
        RunOptions(accumulate=0)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    train_loader, test_loader = loaders(data(), data(64), 64, num_workers=0)
    with pytest.raises(UsageError, match=r"data.accumulate = 5 is more than the 4 batches"):
        train(
            model,
            train_loader,
            test_loader,
            SETTINGS,
            MetricsLog(),
            "dense",
            options=RunOptions(accumulate=5),
        )
    for want, got in zip(before, model.parameters(), strict=True):
        assert torch.equal(want, got)


@pytest.mark.slow
def test_a_crash_resumes_from_the_last_step_boundary_bitwise(tmp_path, monkeypatch):
    from dtp_kernels.pipeline import train as training
    from dtp_kernels.pipeline.run import run
    from utils import DIGITS_RECIPE, final_state, lose_the_node_at

    overrides = ["pretrain.epochs=1", "prune.epochs=2", "finetune.epochs=1", "run.plots=false"]
    recipe = recipes.load(
        DIGITS_RECIPE, [*overrides, "data.accumulate=3", "run.checkpoint_steps=5"]
    )
    recipe["run"]["progress"] = False
    run(recipe, tmp_path / "reference")
    real_step, real_save, saved_steps = training.training_step, training.save_atomic, []
    out = tmp_path / "crashed"
    # batch 52: the DTP stage's epoch 1, batch 7 (22 batches an epoch)
    monkeypatch.setattr(training, "training_step", lose_the_node_at(52, real_step))
    monkeypatch.setattr(
        training,
        "save_atomic",
        lambda payload, path: saved_steps.append(payload["step"]) or real_save(payload, path),
    )
    with pytest.raises(RuntimeError, match="node lost"):
        run(recipe, out)
    monkeypatch.setattr(training, "training_step", real_step)
    # 22 batches an epoch in steps of 3 (the last of 1): checkpoints only between steps
    assert saved_steps and all(step % 3 == 0 for step in saved_steps), saved_steps
    saved = torch.load(out / "checkpoints" / "dtp.pt", weights_only=True)
    assert (saved["epoch"], saved["step"], saved["done"]) == (1, 6, False)
    run(recipe, out, resume=True)
    want, got = final_state(tmp_path / "reference"), final_state(out)
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs"


def ddp_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from dtp_kernels.pipeline import distributed

        reduced = []
        wrap = distributed.wrap

        def counting_wrap(model):
            ddp = wrap(model)

            def hook(state, bucket):
                reduced.append(bucket.index())
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)
            return ddp

        distributed.wrap = counting_wrap
        params, state = trained(16, 2)
        torch.save({"params": params, "state": state, "reduced": reduced}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_accumulating_equal_one_process_on_the_whole_batch(tmp_path):
    # 2 ranks x 2 batches of 16 per step = the 64 samples of one batch in one process
    mp.spawn(ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    want_params, want_state = trained(64, 1)
    for saved in ranks:
        for want, got in zip(want_params, saved["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for key in want_state:
            torch.testing.assert_close(saved["state"][key], want_state[key], rtol=1e-4, atol=1e-5)
        # 2 epochs of 4 optimizer steps, one bucket: one all-reduce per optimizer step
        assert saved["reduced"] == [0] * 8
