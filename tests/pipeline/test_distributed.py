"""Multi-process training (issue 6): 2 processes with the gloo backend on CPU, each on its
shard of the data under DDP. Masks, scores and transport state are identical on every
rank because the pruner's gradients are averaged before each update (the hook
DTPPruner.attach registers under a process group of several ranks: the pipeline's loop,
a user's own loop with prepare() before or after DDP wraps the model, the Hugging Face
Trainer's and Lightning's callbacks alike); without that average they drift apart (the
control). The weights stay equal too: DDP's hooks on the masked weights still fire when
the pruner is made after DDP wrapped the model, as both callbacks make it. The
Trainer's run resumed from its checkpoint on both ranks ends bitwise where the
uninterrupted run ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from utils import checkout_environment, free_port, prune_argv

pytestmark = pytest.mark.slow  # end to end or long: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[2]


def hugging_face_trainer(rank: int, out: str, resume: str | None = None):
    """A tiny Llama under the Trainer (DDP of its own over the running process group),
    four steps, a checkpoint after the second (written by rank 0)."""
    import transformers

    from dtp_kernels.integrations.huggingface import DTPTrainerCallback
    from utils import tiny_llama

    ids = torch.randint(0, 61, (32, 12), generator=torch.Generator().manual_seed(1))
    callback = DTPTrainerCallback({"input_ids": ids[:1]}, {"heads": 0.5, "mlp": 0.5})
    args = transformers.TrainingArguments(
        output_dir=f"{out}/trainer", max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-3, report_to=[], save_strategy="steps", save_steps=2,
        logging_strategy="no", use_cpu=True, disable_tqdm=True, ddp_backend="gloo",
    )  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(
        model=tiny_llama(), args=args, train_dataset=data, callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model, callback.pruner


def hugging_face_trainer_resumed(rank: int, out: str):
    """The Trainer's run, and the same run resumed on both ranks from its checkpoint
    after step 2: every rank ends bitwise where the uninterrupted run ended."""
    whole, whole_pruner = hugging_face_trainer(rank, out)
    dist.barrier()  # rank 0 has written the checkpoint
    model, pruner = hugging_face_trainer(rank, out, resume=f"{out}/trainer/checkpoint-2")
    assert int(pruner.state.steps) == 4
    for one, other in ((whole, model), (whole_pruner, pruner)):
        want, got = one.state_dict(), other.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[key], got[key]) for key in want), f"rank {rank}"
    return model, pruner


def lightning_trainer(rank: int, out: str):
    """A small MLP under Lightning's DDP strategy; its steps run a closure."""
    import lightning

    from dtp_kernels.integrations.lightning import DTPCallback

    class Module(lightning.pytorch.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
            )

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _index):
            return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    )
    callback, module = DTPCallback(torch.randn(1, 8, generator=generator), 0.5), Module()
    trainer = lightning.pytorch.Trainer(
        max_steps=4, callbacks=[callback], accelerator="cpu", strategy="ddp", devices=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return module, callback.pruner


FRAMEWORKS = {
    "trainer": hugging_face_trainer,
    "trainer-resumed": hugging_face_trainer_resumed,
    "lightning": lightning_trainer,
}
LOOPS = ["pipeline", "prepare", "wrapped", *FRAMEWORKS]


def worker(rank: int, port: int, out: str, sync_pruner: bool, loop: str) -> None:
    torch.set_num_threads(1)
    # what the frameworks read to join the process group this worker starts
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from dtp_kernels import DTPPruner, prepare
        from dtp_kernels.models import digits_cnn
        from dtp_kernels.pipeline import recipe
        from dtp_kernels.pipeline.run import build_data
        from dtp_kernels.pipeline.train import MetricsLog, train

        if not sync_pruner:
            DTPPruner._average_over_ranks = lambda self: None
        settings = recipe.load(None, ["prune.epochs=2"])
        train_loader, test_loader = build_data(settings)
        torch.manual_seed(0)
        model = digits_cnn()
        example = next(iter(test_loader))[0][:1]
        first = next(iter(train_loader))[0]
        if loop in FRAMEWORKS:
            model, pruner = FRAMEWORKS[loop](rank, out)
            first = None
        elif loop == "pipeline":
            pruner = DTPPruner(model, example, 0.5)
            train(
                model,
                train_loader,
                test_loader,
                settings["prune"],
                MetricsLog(),
                "dtp",
                pruner=pruner,
            )
        else:  # a user's own loop: prepare(), and DDP around the model before or after
            if loop == "wrapped":
                ddp = torch.nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            pruner = prepare(model, optimizer, example, 0.5)
            if loop == "prepare":
                ddp = torch.nn.parallel.DistributedDataParallel(model)
            for images, labels in train_loader:  # (the DistributedSampler's shard)
                loss = torch.nn.functional.cross_entropy(ddp(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        torch.save(
            {
                "pruner": pruner.state_dict(),
                "masks": pruner.channel_scores(),
                "params": [p.detach() for p in model.parameters()],
                "first": first,
            },
            f"{out}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, sync_pruner: bool, loop: str = "pipeline") -> list[dict]:
    mp.spawn(worker, args=(free_port(), str(tmp_path), sync_pruner, loop), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("loop", LOOPS)
def test_two_gloo_ranks_keep_identical_masks_and_state(tmp_path, loop):
    a, b = run_ranks(tmp_path, sync_pruner=True, loop=loop)
    if a["first"] is not None:  # (the frameworks shard their data: the control shows it)
        assert not torch.equal(a["first"], b["first"])  # each rank on its own shard
    for key in a["pruner"]:
        assert torch.equal(a["pruner"][key], b["pruner"][key]), key
    assert torch.equal(a["masks"], b["masks"])
    assert int(a["pruner"]["state.steps"]) > 0
    for x, y in zip(a["params"], b["params"], strict=True):  # DDP: the weights too
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loop", [loop for loop in LOOPS if loop != "trainer-resumed"])
def test_without_the_pruner_gradient_average_ranks_drift_apart(tmp_path, loop):
    a, b = run_ranks(tmp_path, sync_pruner=False, loop=loop)
    assert not torch.equal(a["pruner"]["scores"], b["pruner"]["scores"])


def cli_rank(rank: int, port: int, out: str) -> None:
    """`dtp prune` (one DTP epoch) on this rank of two, as torchrun starts it: its exit
    code, and whether the process group it started still runs after it."""
    from dtp_kernels.cli import main

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    code = main(prune_argv(Path(out) / "run", ["prune.epochs=1"], "--no-progress"))
    torch.save({"code": code, "group": dist.is_initialized()}, f"{out}/rank{rank}.pt")


def test_the_cli_ends_the_process_group_it_started_on_every_rank(tmp_path):
    """Left running until the interpreter exits, gloo's threads can abort a rank and
    NCCL warns that the group was not destroyed."""
    mp.spawn(cli_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == {"code": 0, "group": False}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_torchrun_runs_the_cli_on_two_processes(tmp_path):
    out = tmp_path / "run"
    command = torchrun_prune(out, epochs=1)
    env = checkout_environment(OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "summary.json").exists() and (out / "checkpoints" / "dtp.pt").exists()
    assert result.stdout.count('"accuracy"') == 1  # rank 0 alone reports


def torchrun_prune(out: Path, *extra: str, epochs: int = 3) -> list[str]:
    """`dtp prune` on the digits recipe under torchrun with 2 processes (`epochs` of DTP)."""
    sets = ["pretrain.epochs=1", f"prune.epochs={epochs}", "finetune.epochs=1"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return [
        sys.executable,
        *torchrun,
        "-m",
        "dtp_kernels",
        *prune_argv(out, sets, "--no-progress", *extra),
    ]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_sigterm_under_torchrun_stops_every_rank_after_one_step_and_resumes(tmp_path):
    """torchrun forwards SIGTERM to its ranks; they agree on the step to stop after,
    rank 0 checkpoints it, and --resume ends where an uninterrupted run ends."""
    from utils import final_state

    env = checkout_environment(OMP_NUM_THREADS="1")
    reference = tmp_path / "uninterrupted"
    subprocess.run(
        torchrun_prune(reference), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600
    )
    out = tmp_path / "run"
    process = subprocess.Popen(
        torchrun_prune(out),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first_epoch = out / "checkpoints" / "dtp.pt"
    while not first_epoch.exists() and process.poll() is None:
        time.sleep(0.005)
    assert process.poll() is None, "the run ended before the DTP stage checkpointed"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "stopped by SIGTERM in stage dtp" in stderr, stderr[-3000:]
    saved = torch.load(first_epoch, weights_only=True)
    assert not saved["done"] and saved["step"] >= 1
    resumed = subprocess.run(
        torchrun_prune(out, "--resume"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = final_state(reference), final_state(out)
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("train_weights", ["true", "false"])
def test_torchrun_prunes_a_hugging_face_language_model_as_one_process(tmp_path, train_weights):
    """A tiny Llama on memory-mapped token ids: 2 torchrun processes of 8 blocks a batch
    end where one process with batches of 16 ends (DDP averages the gradients of the
    model and the pruner; with the weights frozen in the DTP stage, no DDP there and the
    pruner's alone), and rank 0 alone writes the from_pretrained directory."""
    transformers = pytest.importorskip("transformers")
    import numpy as np
    from test_causal_lm import (
        CONFIGS,
        lm_overrides,
        save_llama,
        torchrun_language_model,
        write_text,
    )

    from dtp_kernels.pipeline import recipe
    from dtp_kernels.pipeline.run import run

    model_dir = save_llama(tmp_path / "llama")
    text = write_text(tmp_path / "text", train_bytes=32 * 16 * 23 + 1)  # 23 whole batches
    ids = tmp_path / "ids"
    ids.mkdir()
    for name in ("train", "val"):
        np.save(ids / f"{name}.npy", np.frombuffer((text / f"{name}.txt").read_bytes(), np.uint8))
    sets = [
        *lm_overrides(model_dir, ids),
        "data.tokenizer=pretokenized",
        "finetune.epochs=1",
        f"prune.train_weights={train_weights}",
    ]
    out = tmp_path / "two"
    two = torchrun_language_model(out, [*sets, "data.batch_size=8"])
    one = run(recipe.load(CONFIGS / "causal_lm.yaml", [*sets, "data.batch_size=16"]), None)
    assert [g["k"] for g in two["groups"]] == [g["k"] for g in one["groups"]]
    for key in ("dense_perplexity", "perplexity_before_finetune", "perplexity"):
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "pruned")
    for name, tensor in one["model"].state_dict().items():
        # float sums in another order, through AdamW: a few 1e-6 (batches of 8 alone: 0.1)
        torch.testing.assert_close(saved.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)
