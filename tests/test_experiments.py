"""The python/ experiment scripts run end to end (tiny settings) and write their plots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = [
    ("fig2_toy.py", ["--steps", "60"], "fig2_toy.png"),
    ("fig3_mask_evolution.py", ["--epochs", "2"], "plots/mask_evolution.png"),
    ("fig5_iterations.py", ["--iters", "1,3", "--epochs", "1"], "fig5_iterations.png"),
    ("accuracy_vs_ratio.py", ["--ratios", "0.5,0.8", "--epochs", "1"], "accuracy_vs_ratio.png"),
]


@pytest.mark.parametrize(("script", "args", "plot"), SCRIPTS)
def test_experiment_script_writes_its_plot(tmp_path, script, args, plot):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "python" / script), *args, "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / plot).read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("script", ["table1_cifar.py", "table2_imagenet.py"])
def test_table_scripts_print_their_commands_without_data(script):
    result = subprocess.run([sys.executable, str(ROOT / "python" / script)], cwd=ROOT,
                            capture_output=True, text=True, check=True)  # fmt: skip
    commands = [line for line in result.stdout.splitlines() if line.startswith("python -m")]
    assert len(commands) >= 3 and all(" prune --config configs/" in c for c in commands)
