"""Resumption (issues 6 and 8): a `dtp prune` run killed with SIGKILL at a random moment
and resumed with --resume ends bitwise equal to an uninterrupted run; checkpoint writes
are atomic; a checkpoint from another architecture, ratio or a newer format is refused
with a clear error before anything is loaded."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtp_kernels.pipeline import checkpoint as ckpt
from dtp_kernels.pipeline.errors import RunError
from utils import DIGITS_RECIPE, final_state, prune_command, subprocess_environment

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["pretrain.epochs=2", "prune.epochs=3", "finetune.epochs=2"]


def command(out: Path, *extra: str) -> list[str]:
    return prune_command(out, OVERRIDES, *extra)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "uninterrupted"
    subprocess.run(
        command(reference), env=subprocess_environment(), check=True, capture_output=True
    )
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for attempt in range(4):
        run = tmp_path / f"killed{attempt}"
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        process = subprocess.Popen(command(run), env=subprocess_environment(), **quiet)
        while not (run / "checkpoints").exists() and process.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 1.5) / (attempt + 1))  # a random epoch, mid-step
        if process.poll() is None:
            break
    else:
        pytest.fail("the run always finished before it could be killed")
    process.send_signal(signal.SIGKILL)
    process.wait()
    stages = sorted(p.name for p in (run / "checkpoints").glob("*.pt"))
    assert stages, "killed before the first checkpoint"
    resumed = subprocess.run(
        command(run, "--resume"), env=subprocess_environment(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = final_state(reference), final_state(run)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs (kill seed {seed}, {stages})"
    assert metrics(run) == metrics(reference)
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_a_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "stage.pt"
    ckpt.save_atomic(ckpt.make_payload({"stage": "x"}, epoch=1, done=False), path)

    def torn_save(payload, f):
        f.write(b"half a checkpoint")
        raise OSError("killed while writing")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(RunError, match=f"{path}.*killed while writing.*previous checkpoint"):
        ckpt.save_atomic(ckpt.make_payload({"stage": "x"}, epoch=2, done=False), path)
    assert ckpt.load_checkpoint(path, {"stage": "x"})["epoch"] == 1
    assert not path.with_name(path.name + ".tmp").exists()


def run_pretrain_checkpoint(tmp_path: Path, *overrides: str) -> Path:
    out = tmp_path / "run"
    sets = [
        a
        for s in ("pretrain.epochs=1", "prune.epochs=1", "finetune.epochs=1", *overrides)
        for a in ("--set", s)
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dtp_kernels",
            "prune",
            "--config",
            str(DIGITS_RECIPE),
            *sets,
            "--out",
            str(out),
        ],
        env=subprocess_environment(),
        check=True,
        capture_output=True,
    )
    return out


@pytest.mark.slow
def test_resume_with_another_ratio_or_model_is_refused(tmp_path):
    from dtp_kernels.pipeline import recipe as recipes
    from dtp_kernels.pipeline.run import run

    out = run_pretrain_checkpoint(tmp_path)
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    base = ["pretrain.epochs=1", "prune.epochs=1", "finetune.epochs=1"]
    cases = (
        (
            "prune.ratios=0.7",
            r"dtp.pt was written for prune.ratios = 0.5.*this run has prune.ratios = 0.7",
        ),
        ("prune.budget=global", r"prune.budget = 'layer'.*prune.budget = 'global'"),
        ("pretrain.lr=0.05", r"pretrain.pt was written for pretrain.lr = 0.1.*pretrain.lr = 0.05"),
        ("finetune.epochs=2", r"finetune.pt was written for finetune.epochs = 1.*= 2"),
    )
    for change, message in cases:
        recipe = recipes.load(str(DIGITS_RECIPE), [*base, change])
        with pytest.raises(ckpt.CheckpointError, match=message):
            run(recipe, out, resume=True)
    after = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    assert after == before  # nothing written or half-loaded


def test_newer_format_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "x.pt"
    payload = ckpt.make_payload({"stage": "dtp"}, epoch=1)
    payload["version"] = ckpt.VERSION + 1
    torch.save(payload, path)
    with pytest.raises(ckpt.CheckpointError, match=rf"format version {ckpt.VERSION + 1}.*upgrade"):
        ckpt.load_checkpoint(path, {"stage": "dtp"})
    payload["version"] = ckpt.VERSION - 1
    torch.save(payload, path)
    with pytest.raises(ckpt.CheckpointError, match=r"older dtp-kernels.*new output directory"):
        ckpt.load_checkpoint(path, {"stage": "dtp"})
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ckpt.CheckpointError, match="not a dtp-kernels training checkpoint"):
        ckpt.load_checkpoint(path, {})
    path.write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="not a readable checkpoint"):
        ckpt.load_checkpoint(path, {})


def test_state_dict_mismatch_is_reported_before_loading():
    from dtp_kernels.models import digits_cnn, resnet20

    model = digits_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match="another architecture"):
        ckpt.check_state_dict(model, resnet20().state_dict(), "model", "x.pt")
    smaller = {k: v[..., :1] if v.dim() else v for k, v in before.items()}
    with pytest.raises(ckpt.CheckpointError, match="shape mismatch"):
        ckpt.check_state_dict(model, smaller, "model", "x.pt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_every_piece_of_run_state_is_restored(tmp_path):
    """Save a stage, perturb every piece of state a run holds, restore: each piece equals
    what the checkpoint holds (model, pruner scores and transport state, optimizer,
    scheduler, global RNG, metrics), so a dropped restore fails here by name."""
    from dtp_kernels.models import digits_cnn
    from dtp_kernels.pipeline import data, train
    from dtp_kernels.pruning import DTPPruner

    train_set, test_set = data.digits()
    loader, test_loader = data.loaders(train_set, test_set, 64)
    settings = {"epochs": 2, "lr": 0.1, "schedule": "cosine"}
    checkpoint = train.Checkpointing(tmp_path / "dtp.pt", {"stage": "dtp"})

    def objects(seed: int):
        torch.manual_seed(seed)
        model = digits_cnn()
        pruner = DTPPruner(model, torch.randn(1, 1, 8, 8), 0.5)
        optimizer = train.make_optimizer(model, settings, pruner)
        schedule = train.make_schedule(optimizer, settings, 2 * len(loader))
        return model, pruner, optimizer, schedule

    model, pruner, _, _ = objects(0)
    log = train.MetricsLog()
    train.train(
        model,
        loader,
        test_loader,
        {**settings, "epochs": 1},
        log,
        "dtp",
        pruner=pruner,
        checkpoint=checkpoint,
    )
    saved = torch.load(checkpoint.path, weights_only=True)
    model, pruner, optimizer, schedule = objects(1)  # other weights, scores, state
    torch.rand(100)  # and another RNG position
    perturbed_log = train.MetricsLog()
    perturbed_log.write(stage="other", epoch=9, loss=1.0)
    checkpoint.resume = True
    train._restore(
        checkpoint, model, optimizer, schedule, pruner, perturbed_log, train.RunOptions()
    )

    def same(a, b, what):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), what
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), what
            for key in a:
                same(a[key], b[key], f"{what}.{key}")
        elif isinstance(a, list):
            assert len(a) == len(b), what
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{what}[{i}]")
        else:
            assert a == b, what

    same(model.state_dict(), saved["model"], "model")
    same(pruner.state_dict(), saved["pruner"], "pruner")
    assert int(pruner.state.steps) == len(loader)  # the transport state moved every step
    same(optimizer.state_dict(), saved["optimizer"], "optimizer")
    same(schedule.state_dict(), saved["scheduler"], "scheduler")
    same(torch.get_rng_state(), saved["rng"], "rng")
    same(perturbed_log.rows, saved["log_rows"], "metrics")
