"""examples/: DTP in a user's own training loop without the CLI, in the Hugging Face
Trainer, and under FSDP2 with torchrun."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils import checkout_environment, free_port

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


@pytest.mark.slow  # two processes of torchrun
def test_fsdp2_example_prunes_a_sharded_llama_and_saves_it(tmp_path):
    """examples/fsdp2_llama.py under torchrun, two gloo ranks: the loss falls, half the
    heads and MLP neurons go, and rank 0's save loads with from_pretrained at the pruned
    sizes and runs."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "pruned"
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command = [sys.executable, *torchrun, f"--master_port={free_port()}"]
    command += [str(ROOT / "examples" / "fsdp2_llama.py"), "--steps", "40", "--out", str(out)]
    env = checkout_environment(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone reports
    printed = json.loads(lines[0])
    assert printed["kept"] == [1, 64, 1, 64] and printed["of"] == [2, 128, 2, 128]
    assert printed["loss"][1] < 0.6 * printed["loss"][0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    config = loaded.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.intermediate_size == 64
    assert sum(p.numel() for p in loaded.parameters()) == printed["params"][1]
    ids = torch.arange(16).view(1, 16)
    assert loaded(input_ids=ids).logits.shape == (1, 16, 64)
