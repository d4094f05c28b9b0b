"""The timing helpers the benchmarks share (dtp_kernels/benchmarking.py)."""

import random

import pytest
import torch

import dtp_kernels
from dtp_kernels.benchmarking import interleaved, paired_overhead


def test_paired_overhead_removes_drift_between_rounds():
    rng = random.Random(0)
    drift = [1 + 0.3 * rng.random() for _ in range(60)]  # the machine's speed per round
    base = [100 * d for d in drift]
    case = [102 * d * (1 + rng.uniform(-0.002, 0.002)) for d in drift]
    median, low, high = paired_overhead(case, base)
    assert median == pytest.approx(2.0, abs=0.2)
    assert low <= median <= high and high - low < 0.5  # drift of 30% does not widen it
    unpaired = sorted(case)[30] / sorted(base)[30] - 1  # medians alone keep the drift's noise
    assert abs(100 * unpaired - 2.0) > abs(median - 2.0)


def test_paired_overhead_interval_covers_noise():
    rng = random.Random(1)
    base = [100.0] * 40
    case = [100.0 * (1 + rng.gauss(0, 0.05)) for _ in range(40)]
    _, low, high = paired_overhead(case, base)
    assert low < 0 < high  # no overhead in truth: the interval must include zero
    with pytest.raises(ValueError):
        paired_overhead([1.0, 2.0], [1.0])


def test_sweep_points_for_other_devices_are_left_out(capsys):
    """A point naming its devices (e.g. 1e8 weights, GPUs only) runs there alone."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _harness import Sweep, run_sweep

    seen = []

    def setup(point, device):
        seen.append(point["shape"])
        return {("noop", "full"): (lambda: None, 1)}

    points = [
        {"shape": "small", "dtype": "float32"},
        {"shape": "huge", "dtype": "float32", "devices": ("cuda",)},
        {"shape": "both", "dtype": "float32", "devices": ("cpu", "cuda")},
    ]
    sweep = Sweep(op="noop", title="noop", points=points, setup=setup, warmup=0)
    rows = run_sweep(sweep, torch.device("cpu"), rounds=1, save=False, name="noop")
    assert seen == ["small", "both"] and [r["shape"] for r in rows] == ["small", "both"]


def test_interleaved_reverses_the_order_every_other_round():
    """No case always runs first: the place in a round (warm caches, the allocator's
    state) would bias its paired ratio."""
    calls = []
    cases = {name: (lambda name=name: calls.append(name), 1) for name in "abc"}
    samples = interleaved(cases, rounds=4, device=torch.device("cpu"), warmup=0)
    assert calls == list("abccbaabccba")
    assert {name: len(times) for name, times in samples.items()} == {"a": 4, "b": 4, "c": 4}


def run_script(name: str, *args: str, timeout: int = 300):
    """benchmarks/<name> run in a fresh interpreter; its completed process."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / name
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout
    )


def test_triton_host_benchmark_times_both_paths_without_launches():
    """benchmarks/bench_triton_host.py runs (launches left out, TRITON_INTERPRET set by
    the script) and reports the eager Function, the custom op and the floor."""
    pytest.importorskip("triton")
    done = run_script("bench_triton_host.py", "--no-save", "--rounds", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    for provider in ("| floor |", "| triton |", "| triton, through the custom op |"):
        assert provider in done.stdout, provider


def test_nm_step_profile_names_each_cases_kernels():
    """benchmarks/profile_nm_step.py profiles the 2:4 and one-segment steps against the
    copy and lists the operators of each; a size that is no whole number of 2:4 blocks is
    refused by name."""
    done = run_script("profile_nm_step.py", "--numel", "4096", "--steps", "1", "--no-save")
    assert done.returncode == 0, done.stderr[-2000:]
    backend = dtp_kernels.available_backends("cpu")[-1]  # "cpu", or "torch" without _C
    for case in ("copy of the step's bytes", f"2:4, {backend}", f"one segment, {backend}"):
        assert f"| {case} |" in done.stdout, case
        if not case.startswith("copy"):
            assert f"{case}: per step" in done.stdout, case
    if backend == "cpu":
        assert "| dtp::transport_mask_backward |" in done.stdout
    bad = run_script("profile_nm_step.py", "--numel", "4098", "--no-save")
    assert bad.returncode != 0 and "--numel must be positive multiples of 4" in bad.stderr


def test_compensated_optimizer_benchmark_times_its_five_providers():
    """benchmarks/bench_compensated_optim.py runs and reports every provider per
    optimizer."""
    done = run_script("bench_compensated_optim.py", "--no-save", "--rounds", "1", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for optimizer in ("adamw", "sgd"):
        for provider in (
            "torch bf16",
            "torch fp32",
            "compensated bf16",
            "compensated bf16, fp32 state",
            "compensated bf16 eager",
        ):
            assert f"| {optimizer} | {provider} |" in done.stdout, (optimizer, provider)


def test_tokenize_benchmark_times_both_ways_on_the_same_ids():
    """benchmarks/bench_tokenize.py runs both ways in fresh processes and exits 0 only
    when their ids agree."""
    pytest.importorskip("tokenizers")
    done = run_script("bench_tokenize.py", "--mb", "0.25", "--rounds", "1", "--no-save")
    assert done.returncode == 0, done.stderr[-2000:]
    for way in ("| whole |", "| chunked |"):
        assert way in done.stdout, way


@pytest.mark.slow
def test_timm_sweep_follows_a_refusals_ratios_and_checks_the_export():
    """benchmarks/timm_prune_check.py on one module: CoaT's smallest architecture, whose
    attention feeds a norm over all its channels, is refused at a float ratio, pruned
    again with the ratios the refusal names, and its export equals the hard-masked
    model with the report's parameters and the layers left whole as listed."""
    pytest.importorskip("timm")
    done = run_script("timm_prune_check.py", "--no-save", "--module", "coat", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| coat |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:3] == ["coat_tiny", "pruned with the refusal's ratios"]
    assert float(cells[6]) < 1e-5 and cells[7:9] == ["yes", "yes"]
    assert cells[9].startswith("26 at 0: serial_blocks1.0.factoratt_crpe")


def test_a_sweep_row_of_a_refused_model_says_why_first():
    """A model whose float ratio is refused (its only group feeds a LayerNorm) and whose
    refusal's ratios then leave nothing: the sweeps' row says the first reason, then
    the last."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _prune_sweep import Refused, prune_as_refusals_say

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)
    ).eval()
    x = torch.randn(2, 8)
    refused = prune_as_refusals_say(model, (x,), 0.5, lambda m: m(x))
    assert isinstance(refused, Refused) and refused.first is not refused.last
    why = refused.why()
    assert why.startswith("cannot prune these groups") and "LayerNorm '1'" in why
    assert "; then: the ratios prune nothing of this model" in why


def test_a_sweep_follows_a_refusal_saying_prune_coupled():
    """A conv net whose only width meets a residual add: refused at a float ratio (no
    group without prune_coupled=True), then pruned with it as the refusal says, the
    export equal to the hard-masked model."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _prune_sweep import Pruned, prune_as_refusals_say

    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
            )
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            h = torch.relu(h + self.body(h))
            return self.head(h.mean((2, 3)))

    model = Residual().eval()
    x = torch.randn(2, 3, 10, 10)
    pruned = prune_as_refusals_say(model, (x,), 0.5, lambda m: m(x))
    assert isinstance(pruned, Pruned), pruned.why()
    assert pruned.coupled and pruned.result == "pruned with prune_coupled=True"
    assert pruned.exported.stem[0].out_channels == 4
    torch.testing.assert_close(pruned.exported(x), pruned.want, rtol=1e-5, atol=1e-5)
