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
