"""`run.sharding: fsdp` in `dtp prune`: the DTP and fine-tuning stages trained with FSDP2
(parameters, gradients and optimizer state sharded over the ranks), against the same
recipe unsharded. One process shards over itself (a process group of one); two gloo
ranks under torchrun end where one process on their batches together ends, and a run
stopped mid-stage on two ranks resumes from its checkpoint (whole tensors, cut into
shards again) bitwise where the uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from utils import free_port

pytestmark = pytest.mark.skipif(
    not dist.is_available(), reason="torch.distributed is not available"
)


@pytest.fixture(scope="module")
def llama_and_text(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_causal_lm import save_llama, write_text

    where = tmp_path_factory.mktemp("sharding")
    return save_llama(where / "llama"), write_text(where / "text", train_bytes=32 * 16 * 6 + 1)


def overrides(llama_and_text, *extra: str) -> list[str]:
    from test_causal_lm import lm_overrides

    return [*lm_overrides(*llama_and_text), "finetune.epochs=1", *extra]


def load(sets: list[str]) -> dict:
    from test_causal_lm import CONFIGS

    from dtp_kernels.pipeline import recipe

    return recipe.load(CONFIGS / "causal_lm.yaml", sets)


PERPLEXITIES = ("dense_perplexity", "perplexity_before_finetune", "perplexity")


def assert_same_run(got: dict, want: dict, rel: float, keys=PERPLEXITIES) -> None:
    assert [g["k"] for g in got["groups"]] == [g["k"] for g in want["groups"]]
    assert got["params"] == want["params"]
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=rel), key


@pytest.mark.slow  # end to end: `make test-fast` leaves it out
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["data.accumulate=2"],
        ["model.dtype=bfloat16"],
        ["prune.train_weights=false"],
        ["run.compile=true"],
    ],
    ids=["plain", "accumulate", "bfloat16", "frozen", "compiled"],
)
def test_one_process_sharded_over_itself_trains_as_unsharded(tmp_path, llama_and_text, extra):
    """A process group of one is started for the run (and stopped after it): the same
    kept counts, perplexities and weights as the unsharded run, gradient accumulation
    and clipping (max_grad_norm 1) included; bfloat16 weights with the compensated
    optimizer updating each shard where it lies; the weights frozen in the DTP stage;
    the training step compiled (the sharded model whole, as unsharded)."""
    from dtp_kernels.pipeline.run import run

    sets = overrides(llama_and_text, *extra)
    plain = run(load(sets), None)
    sharded = run(load([*sets, "run.sharding=fsdp"]), tmp_path / "fsdp")
    assert not dist.is_initialized()
    assert_same_run(sharded, plain, rel=1e-5)
    assert next(sharded["model"].parameters()).device.type == "cpu"
    want = plain["model"].state_dict()
    for name, tensor in sharded["model"].state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-4, atol=1e-5)
    saved = torch.load(tmp_path / "fsdp" / "checkpoints" / "dtp.pt", weights_only=True)
    assert not any("DTensor" in type(v).__name__ for v in saved["model"].values())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "pretrain"), [("dtp", 0), ("l1", 0), ("dtp", 1)], ids=["dtp", "l1", "pretrained"]
)
def test_a_cnn_with_the_units_named_trains_as_unsharded(tmp_path, method, pretrain):
    """The digits CNN with its convolutions as units (BN statistics are buffers, not
    sharded) on one process; one-shot L1 pruning shards the fine-tuning alone; a
    pre-training stage trains sharded too, then gathered whole for the pruner."""
    from dtp_kernels.pipeline.run import run

    sets = ["run.device=cpu", "run.progress=false", "prune.epochs=2", "finetune.epochs=1"]
    sets += [f"prune.method={method}", f"pretrain.epochs={pretrain}"]
    plain = run(load_builtin(sets), None)
    units = "run.shard_units=[features.0,features.3]"
    sharded = run(load_builtin([*sets, "run.sharding=fsdp", units]), tmp_path)
    keys = ("dense_accuracy", "accuracy_before_finetune", "accuracy")
    assert_same_run(sharded, plain, rel=1e-5, keys=keys)
    want = plain["model"].state_dict()
    for name, tensor in sharded["model"].state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torchrun_two_ranks_end_where_one_process_on_both_batches_ends(tmp_path, llama_and_text):
    """2 torchrun processes of 8 blocks a batch, sharded, against one process of 16
    unsharded; rank 0 alone writes the from_pretrained directory."""
    transformers = pytest.importorskip("transformers")
    from test_causal_lm import torchrun_language_model

    from dtp_kernels.pipeline.run import run

    sets = overrides(llama_and_text)
    out = tmp_path / "two"
    two = torchrun_language_model(out, [*sets, "data.batch_size=8", "run.sharding=fsdp"])
    one = run(load([*sets, "data.batch_size=16"]), None)
    assert_same_run(two, one, rel=1e-5)
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "pruned")
    for name, tensor in one["model"].state_dict().items():
        torch.testing.assert_close(saved.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)


class StopAt:
    """A preemption guard reporting SIGTERM after the `call`-th optimizer step of the
    run, on every rank alike (as the real guard's agreement gives)."""

    def __init__(self, call: int) -> None:
        self.calls, self.call = 0, call

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False

    def requested(self) -> int | None:
        self.calls += 1
        return signal.SIGTERM if self.calls == self.call else None


STOPS = {"dtp": 5, "finetune": 9}  # the optimizer step of the run to stop after (6 a stage)


def stopped_and_resumed(rank: int, port: int, out: str, sets: list[str]) -> None:
    """On each of two gloo ranks: the run whole, then the run stopped inside each stage
    (the fifth optimizer step, the DTP stage's; the ninth, fine-tuning's third) and
    resumed."""
    from dtp_kernels.pipeline import run as runs
    from dtp_kernels.pipeline.preemption import Preempted

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    real = runs.PreemptionGuard
    try:
        runs.run(load(sets), f"{out}/whole")
        for stage, call in STOPS.items():
            runs.PreemptionGuard = lambda call=call: StopAt(call)
            with pytest.raises(Preempted, match=f"stage {stage}"):
                runs.run(load(sets), f"{out}/stopped-{stage}")
            runs.PreemptionGuard = real
            dist.barrier()  # rank 0 has written the checkpoint
            saved = torch.load(f"{out}/stopped-{stage}/checkpoints/{stage}.pt", weights_only=True)
            assert not saved["done"], f"the stop did not fall inside stage {stage}"
            runs.run(load(sets), f"{out}/stopped-{stage}", resume=True)
    finally:
        runs.PreemptionGuard = real
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_run_stopped_on_two_ranks_resumes_bitwise(tmp_path, llama_and_text):
    """Stopped in the DTP stage or in fine-tuning (the DTP stage then restored whole from
    its checkpoint and exported again), resumed on both ranks: every checkpoint's model,
    optimizer state and pruner state end bitwise where the uninterrupted run's end."""
    sets = overrides(llama_and_text, "data.batch_size=8", "run.sharding=fsdp")
    mp.spawn(stopped_and_resumed, args=(free_port(), str(tmp_path), sets), nprocs=2, join=True)
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    for stopped in STOPS:
        for stage in ("dtp", "finetune"):
            want, got = (
                torch.load(tmp_path / run / "checkpoints" / f"{stage}.pt", weights_only=True)
                for run in ("whole", f"stopped-{stopped}")
            )
            assert got["done"]
            for part in ("model", "optimizer", "pruner"):
                flat_want, flat_got = flatten(want[part]), flatten(got[part])
                assert flat_want.keys() == flat_got.keys(), (stopped, stage, part)
                for key in flat_want:
                    assert torch.equal(flat_want[key], flat_got[key]), (stopped, stage, key)
        summary = json.loads((tmp_path / f"stopped-{stopped}" / "summary.json").read_text())
        assert summary["perplexity"] == whole["perplexity"]


def flatten(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict, by path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if not isinstance(value, (dict, list, tuple)):
        return {}
    out = {}
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        out.update(flatten(item, f"{prefix}/{key}"))
    return out


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("run.amp", "fp16"),
        ("prune.granularity", "weight"),
    ],
)
def test_what_sharding_does_not_cover_is_refused_before_any_work(field, value):
    from dtp_kernels.pipeline.errors import RecipeError

    extra = ["prune.scores=magnitude"] if field == "prune.granularity" else []
    with pytest.raises(RecipeError, match=rf"run.sharding = 'fsdp'.*{field} = .*allowed with it"):
        load_builtin(["run.sharding=fsdp", f"{field}={value}", *extra])
    load_builtin([f"{field}={value}", *extra])  # (the control: allowed unsharded)


def test_shard_units_need_sharding():
    from dtp_kernels.pipeline.errors import RecipeError

    with pytest.raises(RecipeError, match=r"run.shard_units = \['layer1'\].*run.sharding"):
        load_builtin(["run.shard_units=[layer1]"])


def load_builtin(sets: list[str]) -> dict:
    from dtp_kernels.pipeline import recipe

    return recipe.load(None, ["model.weights=random", *sets])


def test_units_are_the_modules_named_or_a_hugging_face_models_blocks():
    from dtp_kernels.models import get_model
    from dtp_kernels.pipeline.errors import UsageError
    from dtp_kernels.pipeline.sharding import units
    from utils import tiny_llama

    resnet = get_model("resnet20", 10)
    named = dict(resnet.named_modules())
    assert units(resnet, ["layer*.?"]) == [
        named[f"layer{i}.{j}"] for i in (1, 2, 3) for j in range(3)
    ]
    with pytest.raises(UsageError, match=r"run.shard_units names 'block\*', which matches no"):
        units(resnet, ["block*"])
    with pytest.raises(UsageError, match=r"'layer1.0' lies inside another unit"):
        units(resnet, ["layer1", "layer1.0"])
    with pytest.raises(UsageError, match=r"needs run.shard_units for CifarResNet"):
        units(resnet, [])
    llama = tiny_llama()
    assert units(llama, []) == list(llama.model.layers)


def test_a_model_without_units_is_refused_before_training(tmp_path):
    from dtp_kernels.pipeline.errors import UsageError
    from dtp_kernels.pipeline.run import run

    with pytest.raises(UsageError, match=r"needs run.shard_units for DigitsCNN"):
        run(load_builtin(["run.sharding=fsdp", "run.device=cpu"]), tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    assert not dist.is_initialized()  # the process group of one is stopped after a failure


class RunningAhead:
    """`time` for train.py with a clock that runs `ahead` seconds further at every read."""

    def __init__(self, ahead: float) -> None:
        self.ahead, self.reads = ahead, 0
        self.perf_counter = time.perf_counter

    def monotonic(self) -> float:
        self.reads += 1
        return time.monotonic() + self.ahead * self.reads


def clocks_apart(rank: int, port: int, out: str, sets: list[str]) -> None:
    """Rank 1's clock finds a checkpoint due after every step, rank 0's never: the ranks
    agree (the checkpoint is gathered by both), and rank 0 counts what it wrote."""
    from dtp_kernels.pipeline import run as runs
    from dtp_kernels.pipeline import train as training

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    training.time = RunningAhead(1e6 if rank == 1 else 0.0)
    real, written = training.save_atomic, []
    training.save_atomic = lambda payload, path: (written.append(path), real(payload, path))
    try:
        runs.run(load(sets), f"{out}/run")
        if rank == 0:
            Path(f"{out}/written.json").write_text(json.dumps(len(written)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_whose_clocks_differ_checkpoint_at_the_same_step(tmp_path, llama_and_text):
    """run.checkpoint_minutes on two ranks: one rank finding a checkpoint due must not
    gather it alone (the other rank would wait in another collective for ever)."""
    sets = overrides(
        llama_and_text, "data.batch_size=8", "run.sharding=fsdp", "run.checkpoint_minutes=1000"
    )
    context = mp.start_processes(
        clocks_apart, args=(free_port(), str(tmp_path), sets), nprocs=2, join=False
    )
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the ranks hung: they disagreed on a checkpoint")
    # per stage: 6 steps an epoch, a checkpoint after steps 2 to 5 (the agreement comes a
    # step late), and one at the epoch's end
    assert json.loads((tmp_path / "written.json").read_text()) == 2 * (4 + 1)
