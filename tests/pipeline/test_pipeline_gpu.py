"""`dtp prune` on a GPU (runs where CUDA is present, skips cleanly elsewhere): CIFAR
ResNet-20 end to end from a CIFAR-format directory in fp32 and bf16, eager and compiled;
a checkpoint written on the CPU resumed on the GPU; torchrun with NCCL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtp_kernels.cli import main
from dtp_kernels.pipeline import synthetic
from utils import DIGITS_RECIPE, checkout_environment

pytestmark = [pytest.mark.cuda, pytest.mark.slow]  # skipped without a GPU (conftest.py)


def recipe_args(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        "data.name=cifar10",
        f"data.root={data}",
        "data.batch_size=32",
        "model.name=resnet20",
        "pretrain.epochs=1",
        "prune.epochs=1",
        "finetune.epochs=1",
        "prune.ratios=0.5",
        "run.progress=false",
        *extra,
    ]
    return [
        "prune",
        "--config",
        str(DIGITS_RECIPE),
        "--out",
        str(out),
        *[a for s in sets for a in ("--set", s)],
    ]


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    return synthetic.write_cifar(tmp_path_factory.mktemp("cifar"), "cifar10", 256, 64)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("amp", ["null", "bf16"], ids=["fp32", "bf16"])
def test_prune_end_to_end_on_cuda(tmp_path, cifar, amp, compiled):
    out = tmp_path / "run"
    extra = [f"run.amp={amp}", f"run.compile={str(compiled).lower()}", "run.channels_last=true"]
    assert main(recipe_args(cifar, out, *extra)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"].startswith("cuda") and summary["speedup"] > 1
    saved = torch.load(out / "checkpoints" / "dtp.pt", weights_only=True)
    assert saved["cuda_rng"] is not None  # the GPU's RNG state is resumable too


def test_checkpoint_written_on_cpu_resumes_on_cuda(tmp_path, cifar):
    out = tmp_path / "run"
    env = checkout_environment()
    command = [
        sys.executable,
        "-m",
        "dtp_kernels",
        *recipe_args(cifar, out, "run.device=cpu", "prune.epochs=3"),
    ]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    while not (out / "checkpoints" / "dtp.pt").exists() and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM
    assert main([*recipe_args(cifar, out, "run.device=cuda", "prune.epochs=3"), "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["device"].startswith("cuda")


def test_torchrun_with_nccl(tmp_path, cifar):
    """The CLI under torchrun on the GPU: two ranks with NCCL where two GPUs exist; with
    one GPU one rank, which starts no process group."""
    ranks = min(2, torch.cuda.device_count())
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "dtp_kernels",
        *recipe_args(cifar, out, "run.device=cuda"),
    ]
    env = checkout_environment()
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # say where it hangs instead of blocking the suite
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"torchrun did not finish in 240 s; its stderr ends:\n{stderr[-3000:]}")
    assert process.returncode == 0, stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["device"] == "cuda:0"


@pytest.mark.parametrize("amp", ["null", "bf16"], ids=["fp32", "bf16"])
def test_prune_a_causal_lm_on_cuda(tmp_path, amp):
    """A tiny Llama saved with save_pretrained, pruned on the GPU from text
    (tests/pipeline/test_causal_lm.py runs the same on the CPU)."""
    pytest.importorskip("transformers")
    from test_causal_lm import lm_recipe, save_llama, write_text

    from dtp_kernels.pipeline.run import run

    settings = lm_recipe(
        save_llama(tmp_path / "llama"), write_text(tmp_path / "text"), "run.device=cuda"
    )
    settings["run"]["amp"] = None if amp == "null" else amp
    summary = run(settings, tmp_path / "run")
    assert summary["device"].startswith("cuda")
    assert summary["perplexity"] < summary["dense_perplexity"]
    assert (tmp_path / "run" / "pruned" / "config.json").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_causal_lm_sharded_on_cuda_trains_as_unsharded(tmp_path, dtype):
    """run.sharding fsdp on one GPU (NCCL, a process group of one): the kept counts and
    perplexities of the unsharded run on the GPU, the summary's model on the CPU
    (tests/pipeline/test_sharding.py runs it on gloo ranks)."""
    pytest.importorskip("transformers")
    from test_causal_lm import lm_recipe, save_llama, write_text

    from dtp_kernels.pipeline.run import run

    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    sets = ("run.device=cuda", f"model.dtype={dtype}", "run.amp=bf16")
    plain = run(lm_recipe(model_dir, text, *sets), None)
    sharded = run(lm_recipe(model_dir, text, *sets, "run.sharding=fsdp"), tmp_path / "run")
    assert [g["k"] for g in sharded["groups"]] == [g["k"] for g in plain["groups"]]
    for key in ("dense_perplexity", "perplexity_before_finetune", "perplexity"):
        assert sharded[key] == pytest.approx(plain[key], rel=1e-3), key
    assert next(sharded["model"].parameters()).device.type == "cpu"
    assert (tmp_path / "run" / "pruned" / "config.json").is_file()
