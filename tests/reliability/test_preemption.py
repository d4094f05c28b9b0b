"""Preemption: SIGTERM, SIGINT and SIGUSR1 (what schedulers send before they stop a job)
finish the current step, write a checkpoint mid-epoch and exit 128 + signal with a
message saying how to resume; `--resume` then ends bitwise equal to an uninterrupted run.

Each signal stops a different stage right after that stage's first checkpoint appears,
so every stage's restore is exercised (the DTP stage's scores and transport state among
them); the model draws dropout masks from the global RNG every step, so a resume that
did not restore the RNG state would train differently."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from utils import final_state, prune_command, subprocess_environment

pytestmark = pytest.mark.slow  # end to end or long: `make test-fast` leaves it out

OVERRIDES = [
    "pretrain.epochs=2",
    "prune.epochs=3",
    "finetune.epochs=2",
    "run.progress=false",
    "model.kwargs={dropout: 0.3}",
]
STOPS = [(signal.SIGTERM, "pretrain"), (signal.SIGINT, "dtp"), (signal.SIGUSR1, "finetune")]


def command(out: Path, *extra: str) -> list[str]:
    return prune_command(out, OVERRIDES, *extra)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    subprocess.run(command(out), env=subprocess_environment(), check=True, capture_output=True)
    return out


@pytest.mark.parametrize(("signum", "stage"), STOPS, ids=[f"{s.name}-{t}" for s, t in STOPS])
def test_signal_checkpoints_mid_epoch_and_resume_is_bitwise_equal(
    tmp_path, uninterrupted, signum, stage
):
    out = tmp_path / "run"
    process = subprocess.Popen(
        command(out),
        env=subprocess_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first_epoch = out / "checkpoints" / f"{stage}.pt"
    while not first_epoch.exists() and process.poll() is None:
        time.sleep(0.002)
    assert process.poll() is None, f"the run ended before the {stage} stage checkpointed"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr[-2000:]
    assert f"stopped by {signal.Signals(signum).name} in stage {stage}" in stderr
    assert "Resume with:" in stderr and stderr.rstrip().endswith("--resume")
    saved = torch.load(first_epoch, weights_only=True)
    assert not saved["done"] and saved["step"] >= 1  # after the step in flight
    assert not (out / "summary.json").exists()
    resumed = subprocess.run(
        command(out, "--resume"), env=subprocess_environment(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = final_state(uninterrupted), final_state(out)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reference = (uninterrupted / "metrics.jsonl").read_text().splitlines()
    assert rows == [json.loads(line) for line in reference]
