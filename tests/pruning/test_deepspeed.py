"""DTP under DeepSpeed (the real library, on CPU, one rank): the Hugging Face Trainer with
a DeepSpeed config trains the pruner under ZeRO stage 0 as it does without DeepSpeed;
ZeRO stages 1 to 3 (whose optimizer fixes its groups when it is made, and whose stage 3
partitions the weights) are refused before any mask, with an error saying what works.

Each run is a process of its own: DeepSpeed and the Trainer's DeepSpeed config keep
global state (stage 3 changes how transformers builds every later model)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtp_kernels import DTPPruner
from utils import checkout_environment, tiny_llama

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
IDS = torch.randint(0, 61, (16, 12), generator=torch.Generator().manual_seed(1))
EXAMPLE = {"input_ids": IDS[:1]}
RATIOS = {"heads": 0.5, "mlp": 0.5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_run(out: Path, stage: int | None) -> dict:
    """Four steps of a tiny Llama under the Trainer and DTPTrainerCallback, with a
    DeepSpeed config of ZeRO `stage` (None: without DeepSpeed). Returns what happened:
    the error, whether the model got masks, the pruner's state file."""
    import transformers
    from torch.nn.utils import parametrize

    from dtp_kernels.integrations.huggingface import DTPTrainerCallback
    from utils import tiny_llama

    deepspeed = None
    if stage is not None:
        deepspeed = {
            "zero_optimization": {"stage": stage},
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
        }
    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, deepspeed=deepspeed, use_cpu=deepspeed is None,
    )  # fmt: skip
    model = tiny_llama()
    callback = DTPTrainerCallback(EXAMPLE, RATIOS, score_lr=0.05)
    data = [{"input_ids": row, "labels": row} for row in IDS]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    try:
        trainer.train()
    except ValueError as error:
        masked = any(parametrize.is_parametrized(m) for m in model.modules())
        return {"error": str(error), "masked": masked}
    torch.save(callback.pruner.state_dict(), out / "pruner.pt")
    return {"error": None, "steps": int(callback.pruner.state.steps)}


def zero3_pruner(out: Path) -> dict:
    """A model built under deepspeed.zero.Init (its weights partitioned), given to
    DTPPruner directly."""
    import deepspeed
    from torch.nn.utils import parametrize

    from dtp_kernels import DTPPruner

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"zero_optimization": {"stage": 3}, "train_batch_size": 1}
    with deepspeed.zero.Init(config_dict_or_path=config):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    try:
        DTPPruner(net, torch.randn(2, 8), 0.5)
    except ValueError as error:
        masked = any(parametrize.is_parametrized(m) for m in net.modules())
        return {"error": str(error), "masked": masked}
    return {"error": None}


def run(scenario: str, tmp_path: Path) -> dict:
    """`scenario` ("stage-N", "plain" or "zero3-pruner") in a process of its own, as
    DeepSpeed's launcher would start one rank."""
    variables = {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "2",
    }  # fmt: skip
    environment = checkout_environment(**variables)
    environment["PYTHONPATH"] += os.pathsep + os.pathsep.join([str(HERE.parent), str(HERE)])
    done = subprocess.run(
        [sys.executable, __file__, scenario, str(tmp_path)],
        env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


def test_zero_stage_0_trains_the_pruner_as_without_deepspeed(tmp_path):
    """DeepSpeed's engine without partitioning steps the Trainer's own torch optimizer,
    which the scores join: four steps end where four steps without DeepSpeed end."""
    plain = run("plain", tmp_path / "plain")
    zero0 = run("stage-0", tmp_path / "stage-0")
    assert plain == zero0 == {"error": None, "steps": 4}
    want = torch.load(tmp_path / "plain" / "pruner.pt", weights_only=True)
    got = torch.load(tmp_path / "stage-0" / "pruner.pt", weights_only=True)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    initial = DTPPruner(tiny_llama(), EXAMPLE, RATIOS).scores.detach()
    assert not torch.allclose(got["scores"], initial)  # the scores learned


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_that_partition_are_refused_before_any_mask(tmp_path, stage):
    """ZeRO 1 and 2 partition the optimizer's groups when it is made (a group added
    later broke its step with an IndexError); stage 3 partitions the weights too."""
    result = run(f"stage-{stage}", tmp_path)
    assert not result["masked"]
    assert result["error"].startswith("optimizer is DeepSpeed's ZeRO optimizer")
    assert "ZeRO stage 0 or DistributedDataParallel" in result["error"]


def test_weights_partitioned_by_zero_3_are_refused_before_any_mask(tmp_path):
    result = run("zero3-pruner", tmp_path)
    assert not result["masked"]
    assert "are sharded (FSDP, tensor parallelism or DeepSpeed ZeRO-3)" in result["error"]
    assert result["error"].startswith("the parameters of '0' and 1 more modules")


if __name__ == "__main__":
    name, directory = sys.argv[1], Path(sys.argv[2])
    directory.mkdir(parents=True, exist_ok=True)
    if name == "zero3-pruner":
        outcome = zero3_pruner(directory)
    else:
        outcome = trainer_run(directory, None if name == "plain" else int(name.split("-")[1]))
    (directory / "result.json").write_text(json.dumps(outcome))
