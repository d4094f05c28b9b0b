"""examples/own_training_loop.py: DTP in a user's own training loop, without the CLI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_own_training_loop_prunes_to_the_exact_counts_and_learns():
    spec = importlib.util.spec_from_file_location(
        "own_training_loop", ROOT / "examples" / "own_training_loop.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--steps", "150", "--ratio", "0.5"])
    groups = result["report"]["groups"]
    assert [(g["n"], g["k"]) for g in groups] == [(32, 16), (64, 32)]
    convs = [m for m in result["model"].modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [16, 32]
    assert result["accuracy"] > 0.5  # ten classes: chance is 10%


def test_hugging_face_trainer_example_prunes_resumes_and_saves(tmp_path):
    """Four steps with a checkpoint every two, then the same command with --resume and
    six steps: it goes on from the fourth step's checkpoint; the export saved with
    save_pretrained loads with from_pretrained at the pruned sizes."""
    spec = importlib.util.spec_from_file_location(
        "hugging_face_trainer", ROOT / "examples" / "hugging_face_trainer.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = str(tmp_path / "run")
    first = example.main(["--out", out, "--steps", "4", "--save-steps", "2"])
    assert first["steps"] == 4
    resumed = example.main(["--out", out, "--steps", "6", "--save-steps", "2", "--resume"])
    assert resumed["steps"] == 6 and int(resumed["pruner"].state.steps) == 6
    config = resumed["model"].config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.intermediate_size == 64
    assert (tmp_path / "run" / "checkpoint-4" / "dtp_pruner.pt").is_file()
