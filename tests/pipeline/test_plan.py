"""`dtp prune --plan` (dtp_kernels/pipeline/plan.py): the groups, kept counts,
parameters and FLOPs it predicts are the run's, and the training state it gives per
stage is the bytes of the weights, gradients and optimizer state the run's checkpoints
hold; it reports the activations of the dense and the masked model (measured as
tests/pipeline/test_activation_memory.py checks); it trains and writes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from test_causal_lm import CONFIGS, lm_recipe, save_llama, write_text

from dtp_kernels.cli import main
from dtp_kernels.pipeline import recipe
from dtp_kernels.pipeline.plan import plan
from dtp_kernels.pipeline.run import run
from utils import DIGITS_RECIPE

transformers = pytest.importorskip("transformers")


def tensor_bytes(tensors) -> int:
    """Bytes of `tensors`, a storage shared by several (tied weights) counted once."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def held(checkpoint, scores: bool) -> int:
    """What a stage's checkpoint says its training held: the model's weights, their
    gradients where the optimizer steps them, the optimizer's state, and the pruner's
    scores (with their gradient) and transport state."""
    statistics = ("running_mean", "running_var", "num_batches_tracked")  # buffers
    model = tensor_bytes(t for k, t in checkpoint["model"].items() if not k.endswith(statistics))
    state = checkpoint["optimizer"]["state"]
    moments = tensor_bytes(t for s in state.values() for k, t in s.items() if k != "step")
    groups = checkpoint["optimizer"]["param_groups"]
    grads = 0
    if groups[0]["params"]:  # the model's weights train
        grads = model
    pruner = 0
    if scores:
        pruner = tensor_bytes(checkpoint["pruner"].values())
        grads += checkpoint["pruner"]["scores"].numel() * 4
    return model + grads + moments + pruner


def test_the_plan_of_a_cnn_is_what_the_run_prunes(tmp_path):
    overrides = ["model.weights=random", "prune.epochs=2", "prune.max_steps=15"]
    overrides += ["finetune.epochs=1", "data.accumulate=2"]
    settings = recipe.load(DIGITS_RECIPE, [*overrides, "run.plots=false"])
    predicted = plan(settings)
    summary = run(settings, tmp_path / "run")
    assert [(g["n"], g["k"]) for g in predicted["groups"]] == [
        (g["n"], g["k"]) for g in summary["groups"]
    ]
    assert predicted["params_after"] == summary["params"]
    assert predicted["speedup"] == pytest.approx(summary["speedup"], rel=1e-12)
    assert predicted["kept_counts"] == "fixed"
    activations = predicted["saved_activation_bytes"]  # tests/pipeline/test_activation_memory.py
    assert set(activations) == {"dense", "dtp"} and activations["dtp"] > activations["dense"]
    steps, checkpoints = predicted["optimizer_steps"], tmp_path / "run" / "checkpoints"
    saved = torch.load(checkpoints / "dtp.pt", weights_only=True)
    assert steps["prune"] == int(saved["pruner"]["state.steps"]) == 15  # max_steps
    for stage in ("pretrain", "finetune"):
        saved = torch.load(checkpoints / f"{stage}.pt", weights_only=True)
        assert steps[stage] == saved["scheduler"]["last_epoch"] > 0, stage
    for stage in ("prune", "finetune"):
        name = "dtp" if stage == "prune" else stage
        saved = torch.load(tmp_path / "run" / "checkpoints" / f"{name}.pt", weights_only=True)
        assert predicted["training_state_bytes"][stage] == held(saved, stage == "prune"), stage


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.dtype=bfloat16", "prune.train_weights=false"],
        [
            "model.dtype=bfloat16",
            "prune.train_weights=false",
            "model.optimizer_state_dtype=bfloat16",
        ],
    ],
    ids=["float32", "bfloat16-frozen", "bfloat16-frozen-bfloat16-state"],
)
def test_the_plan_of_a_language_model_is_what_the_run_holds(tmp_path, overrides):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    settings = lm_recipe(model_dir, text, *overrides)
    predicted = plan(settings)
    summary = run(settings, tmp_path / "run")
    assert predicted["params_after"] == summary["params"]
    assert [(g["n"], g["k"]) for g in predicted["groups"]] == [
        (g["n"], g["k"]) for g in summary["groups"]
    ]
    # one count per kind: the config describes the export (GPT-2's heads cannot:
    # tests/pipeline/test_causal_lm.py)
    assert predicted["saved"] == {"saved": "pruned", "ratios_for_save_pretrained": None}
    assert summary["saved"] == "pruned"
    checkpoints = tmp_path / "run" / "checkpoints"
    dtp = torch.load(checkpoints / "dtp.pt", weights_only=True)
    finetune = torch.load(checkpoints / "finetune.pt", weights_only=True)
    assert predicted["training_state_bytes"] == {
        "prune": held(dtp, scores=True),
        "finetune": held(finetune, scores=False),
    }
    assert predicted["parameter_dtype"] == ("bfloat16" if overrides else "float32")
    state = "bfloat16" if "model.optimizer_state_dtype=bfloat16" in overrides else "float32"
    assert predicted["optimizer_state_dtype"] == state
    activations = predicted["saved_activation_bytes"]
    # frozen weights: a linear layer keeps no input for its weight's gradient
    assert (activations["dtp"] < activations["dense"]) == bool(overrides)


def test_the_command_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    argv = ["prune", "--config", str(CONFIGS / "causal_lm.yaml"), "--plan"]
    sets = [f"model.path={model_dir}", f"data.root={text}", "data.tokenizer=bytes"]
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out), *[a for s in sets for a in ("--set", s)]]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["params_after"] < printed["params_before"]
    # every layer but the output one is cut (tests/pruning/test_left_whole.py)
    assert printed["left_whole"] == {
        "lm_head": "its outputs are the model's outputs: no layer reads them"
    }
    assert not out.exists()
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert main([*argv, "--out", str(out), *[a for s in sets for a in ("--set", s)]]) == 2
    assert "already holds a run" in capsys.readouterr().err
    bad = [*sets, "prune.ratios={heads: 1.5}"]
    assert main([*argv, *[a for s in bad for a in ("--set", s)]]) == 2
    assert "prune.ratios" in capsys.readouterr().err


def test_one_shot_pruning_has_no_dtp_stage_to_hold():
    settings = recipe.load(DIGITS_RECIPE, ["prune.method=l1", "finetune.epochs=0"])
    predicted = plan(settings)
    assert set(predicted["training_state_bytes"]) == {"pretrain"}
    assert set(predicted["saved_activation_bytes"]) == {"dense"}
    steps = predicted["optimizer_steps"]
    assert steps["prune"] == steps["finetune"] == 0 < steps["pretrain"]


def test_a_global_budget_says_the_counts_are_learned(tmp_path):
    settings = recipe.load(DIGITS_RECIPE, ["model.weights=random", "prune.budget=global"])
    predicted = plan(settings)
    assert predicted["kept_counts"] == "learned per group"
    assert predicted["saved"] is None  # not a Hugging Face model
    assert sum(g["k"] for g in predicted["groups"]) == sum(g["n"] for g in predicted["groups"]) // 2


def test_a_learned_budget_says_the_saved_form_is_forecast_from_the_start(tmp_path):
    """Under budget "flops" DTP learns each layer's count: the plan's saved form is the
    one the counts at the start give, and says so."""
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    fixed = plan(lm_recipe(model_dir, text))["saved"]
    assert fixed == {"saved": "pruned", "ratios_for_save_pretrained": None}
    flops = ("prune.budget=flops", "prune.flops_target=0.5")
    learned = plan(lm_recipe(model_dir, text, *flops))["saved"]
    assert learned["saved"] == "pruned"
    assert learned["forecast_from"].startswith("the counts at the start")
