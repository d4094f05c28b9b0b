"""What a user does by mistake and what a cluster does to a job (issue 20): a run is never
overwritten or mixed with another, a bad recipe field is refused before any work with a
one-line error naming it, divergence fails instead of exporting NaN, resume checks the
fields each stage depends on, and a failed checkpoint write keeps the previous one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtp_kernels import cli
from dtp_kernels.pipeline import out_dir
from dtp_kernels.pipeline import recipe as recipes
from dtp_kernels.pipeline.errors import RecipeError
from utils import DIGITS_RECIPE, checkout_environment, prune_argv

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["pretrain.epochs=1", "prune.epochs=1", "finetune.epochs=1", "run.plots=false"]


def prune(out: Path, *overrides: str, extra: tuple[str, ...] = ()) -> int:
    """`dtp prune` on the digits recipe, in this process; its exit status."""
    return cli.main(prune_argv(out, [*QUICK, *overrides], "--no-progress", *extra))


def strict_rows(path: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (NaN and Infinity are not JSON)."""

    def refuse(token: str):
        raise ValueError(f"non-JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# -- 1. never destroy a run ------------------------------------------------------------


def test_second_run_into_a_used_directory_is_refused_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert prune(out) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert prune(out, "seed=1") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "--resume" in err and "--overwrite" in err
    assert len(err.splitlines()) == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_overwrite_replaces_the_run_and_keeps_other_files(tmp_path):
    out = tmp_path / "run"
    assert prune(out) == 0
    (out / "notes.txt").write_text("mine")
    first = strict_rows(out / "metrics.jsonl")
    assert prune(out, "seed=1", extra=("--overwrite",)) == 0
    rows = strict_rows(out / "metrics.jsonl")
    assert len(rows) == len(first)  # the old rows are gone, not appended to
    assert rows != first  # another seed: another run's rows
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / out_dir.LOCK).exists()  # released at the end


def test_resume_with_nothing_to_resume_and_both_flags_are_errors(tmp_path, capsys):
    assert prune(tmp_path / "empty", extra=("--resume",)) == 2
    assert "holds no checkpoint to resume from" in capsys.readouterr().err
    assert prune(tmp_path / "x", extra=("--resume", "--overwrite")) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_a_live_run_holds_the_directory_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"pid": sleeper.pid, "host": os.uname().nodename, "started": 0}
        (out / out_dir.LOCK).write_text(json.dumps(record))
        assert prune(out) == 2
        err = capsys.readouterr().err
        assert f"in use by another run (pid {sleeper.pid}" in err
        assert not (out / "metrics.jsonl").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert prune(out) == 0  # the same lock, its process gone: stale
    err = capsys.readouterr().err
    assert f"taking over the stale lock {out / out_dir.LOCK} of pid {sleeper.pid}" in err
    assert not (out / out_dir.LOCK).exists()


# -- 2. a typed recipe, validated whole before any work --------------------------------

BAD_FIELDS = [
    ("prune.lr=fast", "prune.lr = 'fast' (from --set prune.lr=fast)", "a finite number > 0"),
    ("finetune.milestones=5", "finetune.milestones = 5", "a list of epochs"),
    ("seed=abc", "seed = 'abc'", "an integer >= 0"),
    ("finetune.schedule=cosin", "finetune.schedule = 'cosin'", "['cosine', 'step']"),
    ("prune.epochs=-1", "prune.epochs = -1", "an integer >= 0"),
    ("prune.epochs=0", "prune.epochs = 0", "needs prune.epochs >= 1"),
    ("prune.budget=flops", "prune.budget = 'flops'", "needs prune.flops_target"),
    ("prune.ratios=[a:b]", "prune.ratios = ['a:b']", "is not a number"),
    ('prune.ratios="[a:b]"', "prune.ratios = '[a:b]'", "'index:ratio'"),
    ("prune.ratios=1.5", "prune.ratios = 1.5", "outside [0, 1)"),
    ("pretrain.lr=.nan", "pretrain.lr = nan", "a finite number"),
    ("run.amp=fp8", "run.amp = 'fp8'", "[None, 'bf16', 'fp16']"),
    ("data.batch_size=0", "data.batch_size = 0", "an integer >= 1"),
    ("prune=3", "'prune' is a section", "prune.KEY=VALUE"),
    ("prune.lr", "is not of the form section.key=value", ""),
    ("prune.typo=1", "unknown recipe field 'prune.typo'", "known:"),
    ("prune.scores=abs", "prune.scores = 'abs'", "['learned', 'magnitude']"),
    ("prune.scores=magnitude", "prune.scores = 'magnitude'", "granularity weight or n:m"),
]


@pytest.mark.parametrize("override,names,allowed", BAD_FIELDS, ids=[c[0] for c in BAD_FIELDS])
def test_bad_field_is_one_error_line_before_any_work(tmp_path, capsys, override, names, allowed):
    out = tmp_path / "run"
    assert cli.main(prune_argv(out, ["pretrain.epochs=50", override])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert names in err and allowed in err
    assert not out.exists()  # refused before the run touched anything


def test_error_names_the_recipe_file_a_value_came_from(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("prune: {lr: fast}\n")
    with pytest.raises(RecipeError, match=rf"prune.lr = 'fast' \(from recipe {path}\)"):
        recipes.load(path)


def test_every_default_field_has_a_check_and_the_shipped_recipes_pass():
    from dtp_kernels.pipeline import schema

    assert set(schema.flatten(recipes.DEFAULTS)) == set(schema.FIELDS)
    for path in [DIGITS_RECIPE, *sorted(DIGITS_RECIPE.parent.glob("paper/*.yaml"))]:
        recipes.load(path)


def test_per_stage_ratio_list_is_accepted_and_resolved_per_stage():
    from dtp_kernels.models import get_model
    from dtp_kernels.pipeline.run import check_pruning_plan

    recipe = recipes.load(None, ["prune.ratios=[0, 0.5, 0.5, 0.5]", "model.name=resnet56"])
    assert recipe["prune"]["ratios"] == [0, 0.5, 0.5, 0.5]
    model = get_model("resnet56", 10)
    check_pruning_plan(model, recipe["prune"], torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="gives 3 stages, the model has 4"):
        check_pruning_plan(
            model, {**recipe["prune"], "ratios": [0, 0.5, 0.5]}, torch.randn(1, 3, 32, 32)
        )


def test_a_ratio_that_does_not_fit_the_model_stops_before_pretraining(tmp_path, capsys):
    out = tmp_path / "run"
    assert prune(out, "pretrain.epochs=50", "prune.ratios=[0.5, 0.5]") == 2
    assert "gives 2 stages, the model has 1 (the stem)" in capsys.readouterr().err
    assert not (out / "checkpoints").exists()


# -- 3. divergence is a failure --------------------------------------------------------


def test_divergence_stops_the_stage_exports_nothing_and_keeps_json_valid(tmp_path, capsys):
    out = tmp_path / "run"
    assert prune(out, "prune.lr=1.0e+30") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: dtp-0.5: the training loss is") and "at epoch 0, step" in err
    assert "Lower prune.lr" in err and len(err.strip().splitlines()) == 1
    assert not (out / "pruned.pt").exists() and not (out / "summary.json").exists()
    assert not (out / "checkpoints" / "dtp.pt").exists()
    assert torch.load(out / "checkpoints" / "pretrain.pt", weights_only=True)["done"]
    strict_rows(out / "metrics.jsonl")  # raises on NaN or Infinity


def test_non_finite_values_become_null_in_metrics(tmp_path):
    from dtp_kernels.pipeline.train import MetricsLog

    log = MetricsLog(tmp_path / "m.jsonl")
    log.write(stage="x", epoch=0, loss=float("nan"), masks={"a": [1.0, float("inf")]})
    assert strict_rows(tmp_path / "m.jsonl") == [
        {"stage": "x", "epoch": 0, "loss": None, "masks": {"a": [1.0, None]}}
    ]


def test_a_model_with_nan_is_not_exported():
    from dtp_kernels.models import digits_cnn
    from dtp_kernels.pipeline.errors import DivergedError
    from dtp_kernels.pipeline.run import check_finite

    model = digits_cnn()
    check_finite(model)
    name, parameter = next(iter(model.named_parameters()))
    with torch.no_grad():
        parameter[0] = float("nan")
    with pytest.raises(DivergedError, match=f"pruned model's {name} holds NaN"):
        check_finite(model)


# -- 4. resume checks what each stage depends on ---------------------------------------


def test_fixing_a_pruning_field_reuses_the_finished_pretraining(tmp_path):
    out = tmp_path / "run"
    assert prune(out) == 0
    for stage in ("dtp", "finetune"):
        (out / "checkpoints" / f"{stage}.pt").unlink()
    pretrain = (out / "checkpoints" / "pretrain.pt").read_bytes()
    assert prune(out, "prune.ratios=0.7", extra=("--resume",)) == 0
    assert (out / "checkpoints" / "pretrain.pt").read_bytes() == pretrain
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ratios"] == 0.7 and summary["seconds"]["pretrain"] > 0
    stages = [r["stage"] for r in strict_rows(out / "metrics.jsonl") if "loss" in r]
    assert stages.count("pretrain") == 1  # restored, not trained again


def test_stage_fields_separate_what_each_stage_depends_on():
    from dtp_kernels.pipeline.run import stage_fields

    recipe = recipes.load(DIGITS_RECIPE)
    pretrain, dtp, finetune = (stage_fields(recipe, s) for s in ("pretrain", "dtp", "finetune"))
    assert "pretrain.lr" in pretrain and not any(k.startswith("prune.") for k in pretrain)
    assert "prune.ratios" in dtp and not any(k.startswith("finetune.") for k in dtp)
    assert "finetune.lr" in finetune and "data.num_workers" not in finetune
    assert "data.batch_size" in pretrain and "data.root" not in pretrain  # the data may move
    assert set(pretrain) < set(dtp) < set(finetune)


# -- 7. a failed checkpoint write -------------------------------------------------------


def test_a_full_disk_while_checkpointing_stops_with_the_path_and_keeps_the_last(
    tmp_path, monkeypatch, capsys
):
    from dtp_kernels.pipeline import checkpoint

    out = tmp_path / "run"
    real_save, calls = torch.save, []

    def save_until_full(payload, f, *args, **kwargs):
        calls.append(payload.get("meta", {}).get("pretrain.epochs"))
        if len(calls) > 1:  # the second checkpoint: the disk is full
            f.write(b"part")
            raise OSError(28, "No space left on device")
        return real_save(payload, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save_until_full)
    assert prune(out, "pretrain.epochs=2") == 1
    err = capsys.readouterr().err
    path = out / "checkpoints" / "pretrain.pt"
    assert f"could not write the checkpoint {path}" in err and "No space left" in err
    assert "the previous checkpoint there is kept" in err
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    kept = torch.load(path, weights_only=True)
    assert kept["epoch"] == 1 and not kept["done"]
    assert not list((out / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_torchrun_restarts_a_lost_rank_and_ends_bitwise_equal(tmp_path):
    """2 gloo ranks; rank 1 is SIGKILLed in the middle of a DTP epoch; torchrun
    (--max-restarts 1) restarts the group, which resumes from the last mid-epoch
    checkpoint (run.checkpoint_steps) and ends bitwise where an uninterrupted run ends."""
    from utils import final_state

    sets = [
        "pretrain.epochs=1",
        "prune.epochs=3",
        "finetune.epochs=1",
        "run.plots=false",
        "run.checkpoint_steps=5",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2", "--max-restarts", "1"]
    script = str(Path(__file__).with_name("kill_one_rank.py"))
    env = checkout_environment(OMP_NUM_THREADS="1")
    runs = {}
    for name, kill_at in (("uninterrupted", 0), ("killed", 30)):  # 11 steps an epoch a rank
        out = tmp_path / name
        command = [*torchrun, script, *prune_argv(out, sets, "--no-progress")]
        result = subprocess.run(
            command,
            cwd=ROOT,
            env={**env, "DTP_TEST_KILL_AT_STEP": str(kill_at)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("exitcode: -9" in result.stderr) == (kill_at > 0)  # rank 1 was lost, once
        assert not (out / out_dir.LOCK).exists()
        runs[name] = out
    want, got = final_state(runs["uninterrupted"]), final_state(runs["killed"])
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs"
    assert strict_rows(runs["killed"] / "metrics.jsonl") == strict_rows(
        runs["uninterrupted"] / "metrics.jsonl"
    )


# -- 5. bounded loss on interruption ----------------------------------------------------


@pytest.mark.slow
def test_a_crash_mid_epoch_resumes_from_the_last_step_checkpoint_bitwise(tmp_path, monkeypatch):
    from dtp_kernels.pipeline import train
    from dtp_kernels.pipeline.run import run
    from utils import final_state, lose_the_node_at

    recipe = recipes.load(DIGITS_RECIPE, [*QUICK, "pretrain.epochs=2", "run.checkpoint_steps=5"])
    recipe["run"]["progress"] = False
    run(recipe, tmp_path / "reference")
    real_step = train.training_step
    out = tmp_path / "crashed"
    monkeypatch.setattr(train, "training_step", lose_the_node_at(30, real_step))
    with pytest.raises(RuntimeError, match="node lost"):
        run(recipe, out)
    monkeypatch.setattr(train, "training_step", real_step)
    saved = torch.load(out / "checkpoints" / "pretrain.pt", weights_only=True)
    # 22 steps an epoch, a checkpoint every 5: the last before step 30 is at step 27
    assert (saved["epoch"], saved["step"], saved["done"]) == (1, 5, False)
    summary = run(recipe, out, resume=True)
    assert summary["seconds"]["pretrain"] > saved["seconds"]  # the whole stage's time
    want, got = final_state(tmp_path / "reference"), final_state(out)
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs"
    assert strict_rows(out / "metrics.jsonl") == strict_rows(
        tmp_path / "reference" / "metrics.jsonl"
    )


def test_checkpoint_minutes_writes_within_epochs(tmp_path, monkeypatch):
    from dtp_kernels.pipeline import train

    written = []
    real = train.save_atomic
    monkeypatch.setattr(
        train,
        "save_atomic",
        lambda payload, path: written.append(payload["step"]) or real(payload, path),
    )
    assert prune(tmp_path / "run", "run.checkpoint_minutes=1.0e-9") == 0
    assert sorted(set(written)) == list(range(22))  # every step of an epoch, and its end


# -- 6. untrusted files -----------------------------------------------------------------


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_cifar_file_that_would_run_code_is_refused(tmp_path):
    import pickle

    from dtp_kernels.pipeline import data, synthetic
    from dtp_kernels.pipeline.errors import UsageError

    where = synthetic.write_cifar(tmp_path, "cifar10", train=20, test=4)
    marker = tmp_path / "ran"
    (where / "data_batch_3").write_bytes(pickle.dumps({"data": _RunsCode(marker)}))
    with pytest.raises(UsageError, match=r"data_batch_3 was not read: it refers to posix.system"):
        data.cifar(tmp_path, "cifar10")
    assert not marker.exists()
    (where / "test_batch").write_bytes((where / "data_batch_1").read_bytes()[:100])
    (where / "data_batch_3").write_bytes((where / "data_batch_1").read_bytes())
    with pytest.raises(UsageError, match=r"test_batch was not read: pickle data was truncated"):
        data.cifar(tmp_path, "cifar10")


def test_load_pruned_says_what_is_wrong_with_the_file(tmp_path):
    from dtp_kernels import load_pruned, save_pruned
    from dtp_kernels.models import digits_cnn

    with pytest.raises(FileNotFoundError, match=r"missing\.pt does not exist"):
        load_pruned(tmp_path / "missing.pt")
    model = digits_cnn()
    for name, architecture in (
        ("built.pt", {"name": "digits_cnn", "num_classes": 10}),
        ("any.pt", None),
    ):
        save_pruned(tmp_path / name, model, architecture)
        whole = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(whole[: len(whole) // 2])
        with pytest.raises(ValueError) as error:
            load_pruned(tmp_path / name)
        assert str(tmp_path / name) in str(error.value) and "trusted" not in str(error.value)
    save_pruned(tmp_path / "any.pt", model)
    with pytest.raises(ValueError, match=r"pickled module.*trusted=True"):
        load_pruned(tmp_path / "any.pt")


def test_an_unreadable_image_is_named_or_skipped_and_counted(tmp_path):
    from torch.utils.data import DataLoader

    from dtp_kernels.pipeline import data, synthetic
    from dtp_kernels.pipeline.errors import UsageError

    root = synthetic.write_image_folder(tmp_path, classes=2, per_class=3, size=40)
    bad = root / "train" / "class0000" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    train, _ = data.image_folder(root, size=32)
    index = [p for p, _ in train.samples].index(str(bad))
    with pytest.raises(UsageError, match=rf"{bad}: the image cannot be read.*skip_bad_files"):
        train[index]
    with pytest.raises(UsageError) as raised:  # from a loader worker: torch adds its traceback
        list(DataLoader(train, batch_size=2, num_workers=1))
    assert cli._one_line(raised.value).startswith(f"{bad}: the image cannot be read")
    train, _ = data.image_folder(root, size=32, skip_bad_files=True)
    image, label = train[index]
    assert image.shape == (3, 32, 32) and label == train.samples[index + 1][1]
    loader = DataLoader(train, batch_size=2, num_workers=2)  # workers are other processes
    assert sum(len(labels) for _, labels in loader) == len(train)
    assert data.skipped_files(loader) == [str(bad)]


def test_the_summary_lists_the_skipped_images(tmp_path):
    from dtp_kernels.pipeline import synthetic

    root = synthetic.write_image_folder(tmp_path / "images", classes=2, per_class=4, size=40)
    bad = root / "val" / "class0001" / "0.jpg"
    bad.write_bytes(b"not an image")
    sets = [
        f"data.root={root}",
        "data.name=imagefolder",
        "data.image_size=32",
        "data.batch_size=4",
        "data.num_workers=0",
        "data.skip_bad_files=true",
        "model.name=resnet20",
        "model.num_classes=2",
    ]
    out = tmp_path / "run"
    assert prune(out, *sets) == 0
    assert json.loads((out / "summary.json").read_text())["skipped_files"] == [str(bad)]


# -- 8. what determinism holds over -----------------------------------------------------


@pytest.mark.slow
def test_each_thread_count_is_bitwise_equal_to_itself(tmp_path):
    from utils import final_state, prune_command, subprocess_environment

    finals = {}
    for threads in (1, 2):
        for attempt in range(2):
            out = tmp_path / f"threads{threads}-{attempt}"
            env = {**subprocess_environment(), "OMP_NUM_THREADS": str(threads)}
            subprocess.run(prune_command(out, QUICK), env=env, check=True, capture_output=True)
            finals[threads, attempt] = final_state(out)
    for threads in (1, 2):
        first, second = finals[threads, 0], finals[threads, 1]
        assert first.keys() == second.keys()
        for key in first:
            assert torch.equal(first[key], second[key]), f"{threads} threads: {key} differs"
