"""The package ships its type hints (PEP 561's py.typed): a user's code that calls the
public API as documented type-checks with mypy against them (and runs), and a wrong
call is reported. mypy sees dtp_kernels as an installed package, as a user's mypy does (its
own modules are not checked here, only the calls into them)."""

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# every public entry point, called as the README and docs/ call them
USER_CODE = """
from pathlib import Path

import torch
from torch import nn

import dtp_kernels
from dtp_kernels import (
    DTPPruner,
    L1Pruner,
    TransportState,
    conv1d_to_linear,
    load_pruned,
    masked_channel_epilogue,
    prepare,
    save_pruned,
    transport_mask,
)


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))


def train(directory: Path) -> float:
    model, x = small_cnn(), torch.randn(1, 3, 8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner: DTPPruner = prepare(model, optimizer, x, 0.5, eps=1.0)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    by_name = DTPPruner(small_cnn(), (x,), {"0": 0.5}, budget="layer")
    stages = DTPPruner(small_cnn(), x, [0.5], budget="global")
    paper = L1Pruner(small_cnn(), x, "[0:0.5, 1-1:0]")
    counts: list[int] = pruner.kept_counts()
    masks: list[torch.Tensor] = pruner.hard_masks()
    whole: dict[str, str] = pruner.left_whole
    report: dict = pruner.report()
    small: nn.Module = pruner.export()
    save_pruned(directory / "small", small, metadata={"ratio": 0.5})
    again: nn.Module = load_pruned(directory / "small", map_location="cpu", trusted=True)
    state = TransportState([5, 3], device="cpu")
    scores = torch.rand(8, requires_grad=True)
    mask = transport_mask(scores, [2.0, 1.0], state, eps=0.5)
    mask.sum().backward()  # one tensor in, one tensor out
    parts = transport_mask([torch.rand(5), torch.rand(3)], [2.0, 1.0], state)
    first: torch.Tensor = parts[0]
    state.commit()
    y = masked_channel_epilogue(torch.randn(2, 8, 4, 4), torch.rand(8), activation="relu")
    backends: list[str] = dtp_kernels.available_backends("cpu")
    linear = conv1d_to_linear(small)
    assert counts == [4] and stages.kept_counts() == [4] and paper.kept_counts() == [4]
    assert by_name.kept_counts() == [4] and len(masks) == 1 and whole == {}
    assert report["groups"] and linear is small
    assert again.state_dict().keys() == small.state_dict().keys()
    assert first.shape == (5,) and backends and scores.grad is not None
    return float(y.sum()) + float(mask.detach().sum())
"""

# calls the hints rule out, each with the error mypy must give
WRONG_CALLS = {
    "DTPPruner(nn.Linear(2, 2), torch.randn(1, 2), {'0': '0.5'})": "dict-item",
    "transport_mask(torch.rand(8), [2.0], TransportState([8]), iters='1')": "call-overload",
    "transport_mask([torch.rand(8)], [2.0], TransportState([8])).sum()": "attr-defined",
    "load_pruned(3)": "arg-type",
}


def mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """mypy on `code` written to a user's file outside the checkout, with the checkout's
    package importable as installed (on the path), not as the user's source."""
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")]
    command += ["--no-error-summary", "--show-error-codes", str(script)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_the_documented_calls_type_check_and_wrong_ones_are_reported(tmp_path):
    assert (ROOT / "dtp_kernels" / "py.typed").is_file()
    checked = mypy(tmp_path, USER_CODE)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    namespace: dict = {}
    exec(compile(USER_CODE, "user.py", "exec"), namespace)  # and it runs as written
    assert namespace["train"](tmp_path) > 0
    header = USER_CODE.split("\n\ndef train")[0]
    code = header + "".join(
        f"\n\ndef wrong_{i}() -> None:\n    {c}\n" for i, c in enumerate(WRONG_CALLS)
    )
    checked = mypy(tmp_path, code)
    lines = textwrap.dedent(code).splitlines()
    for call, error in WRONG_CALLS.items():
        line = next(i for i, text in enumerate(lines, 1) if text.strip() == call)
        reported = [
            r for r in checked.stdout.splitlines() if r.startswith(f"user.py:{line}: error")
        ]
        assert any(f"[{error}]" in r for r in reported), (call, checked.stdout)


def _config_without_exemptions(tmp_path: Path) -> tuple[Path, list[str]]:
    """pyproject.toml's mypy configuration as an ini file, less the override that leaves
    modules' errors unreported; and the modules that override lists."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    lines = ["[mypy]"]
    lines += [f"{key} = {_ini(value)}" for key, value in config.items() if key != "overrides"]
    exempt: list[str] = []
    for override in config["overrides"]:
        if override.get("ignore_errors"):
            exempt += override["module"]
            continue
        lines.append(f"[mypy-{','.join(override['module'])}]")
        lines += [f"{key} = {_ini(value)}" for key, value in override.items() if key != "module"]
    path = tmp_path / "mypy.ini"
    path.write_text("\n".join(lines) + "\n")
    return path, exempt


def _ini(value: object) -> str:
    if isinstance(value, bool):
        return str(value)
    return ",".join(value) if isinstance(value, list) else str(value)


@pytest.mark.slow
def test_only_the_listed_modules_have_type_errors_and_each_of_them_has_some(tmp_path):
    """`make lint` runs mypy on the package with pyproject.toml's configuration. An
    `ignore_errors` override would leave the errors of the modules it lists unreported
    (none is listed now: every module is clean); run without it, only those modules may
    have errors, and each of them must (a module that became clean leaves the list)."""
    config, exempt = _config_without_exemptions(tmp_path)
    command = [sys.executable, "-m", "mypy", "--config-file", str(config)]
    command += ["--cache-dir", str(tmp_path / "cache"), "--no-error-summary"]
    checked = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert checked.returncode in (0, 1), checked.stdout + checked.stderr
    erring = {
        line.split(":")[0].removesuffix(".py").replace("/", ".")
        for line in checked.stdout.splitlines()
        if ": error:" in line
    }
    assert sorted(erring - set(exempt)) == [], checked.stdout
    assert sorted(set(exempt) - erring) == [], "clean now: remove them from pyproject.toml"
