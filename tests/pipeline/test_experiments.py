"""The python/ experiment scripts run end to end (tiny settings) and write their plots.

They run in this process as `python SCRIPT` would run them (runpy, as __main__, with
their argv): a subprocess would spend most of its time importing torch again."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end to end or long: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = [
    ("fig2_toy.py", ["--steps", "60"], "fig2_toy.png"),
    ("fig3_mask_evolution.py", ["--epochs", "2"], "plots/mask_evolution.png"),
    ("fig4_iterations.py", ["--iters", "1,3", "--epochs", "1"], "fig4_iterations.png"),
    ("accuracy_vs_ratio.py", ["--ratios", "0.5,0.8", "--epochs", "1"], "accuracy_vs_ratio.png"),
]


def run_script(monkeypatch, script: str, *args: str) -> None:
    """`python python/SCRIPT ARGS` from the checkout's root, in this process; fails
    unless it exits 0. sys.path and the working directory are restored afterwards."""
    path = ROOT / "python" / script
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts prepend the checkout
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (0, None), f"{script} exited with {stop.code}"


@pytest.mark.parametrize(("script", "args", "plot"), SCRIPTS)
def test_experiment_script_writes_its_plot(tmp_path, monkeypatch, script, args, plot):
    out = tmp_path / "out"
    run_script(monkeypatch, script, *args, "--out", str(out))
    assert (out / plot).read_bytes().startswith(b"\x89PNG")


TABLES = {
    "table1_cifar.py": ["table1-resnet56", "table1-vgg19"],
    "table2_unstructured.py": ["table2-resnet50-unstructured"],
    "table3_mobilenetv2.py": ["table3-mobilenetv2"],
    "table4_imagenet.py": ["table4-resnet34", "table4-resnet50"],
    "table8_wrn26_flops.py": ["table8-wrn26"],
}


def test_every_paper_experiment_has_a_table_script():
    from dtp_kernels.pipeline.experiments import EXPERIMENTS

    assert sorted(n for names in TABLES.values() for n in names) == sorted(EXPERIMENTS)


@pytest.mark.parametrize("script", sorted(TABLES))
def test_table_scripts_say_what_they_need_and_print_their_commands(monkeypatch, capsys, script):
    run_script(monkeypatch, script)
    stdout = capsys.readouterr().out
    assert "data.root = data/" in stdout and "model.weights = weights/" in stdout
    commands = [line for line in stdout.splitlines() if line.startswith("python -m")]
    assert [c.split()[4] for c in commands] == TABLES[script]
    assert all(" paper " in c and "--seeds 0 1 2" in c for c in commands)
