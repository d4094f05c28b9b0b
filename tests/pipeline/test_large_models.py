"""Settings of `dtp prune` for models near the device's memory, on a tiny Hugging Face
Llama: prune.train_weights false (the DTP stage learns the masks alone: no gradients or
optimizer state for the weights), model.dtype bfloat16 (half the bytes of weights,
gradients and optimizer state), and one copy of the model in a run."""

from __future__ import annotations

import json
import types

import pytest
import torch
from test_causal_lm import lm_recipe, save_llama, write_text

from dtp_kernels.pipeline import recipe
from dtp_kernels.pipeline import run as run_module
from dtp_kernels.pipeline import train as train_module
from dtp_kernels.pipeline.errors import RecipeError
from dtp_kernels.pipeline.run import run

transformers = pytest.importorskip("transformers")

NEVER_PRUNED = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
)


def dense_weights(model_dir) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


@pytest.mark.parametrize("train_weights", [False, True])
def test_a_frozen_dtp_stage_learns_the_masks_and_leaves_the_weights(tmp_path, train_weights):
    """Without fine-tuning, the weights no mask touches are the dense ones, bitwise,
    when the DTP stage is frozen (and moved when it is not: the control); the masks
    moved either way, and the stage's optimizer holds the pruner's scores alone."""
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    settings = lm_recipe(
        model_dir, text, f"prune.train_weights={str(train_weights).lower()}", "finetune.epochs=0"
    )
    summary = run(settings, tmp_path / "run")
    pruned, dense = summary["model"].state_dict(), dense_weights(model_dir)
    same = [torch.equal(pruned[name], dense[name]) for name in NEVER_PRUNED]
    assert same == [not train_weights] * len(NEVER_PRUNED)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    traces = [json.loads(r)["masks"] for r in rows if json.loads(r)["stage"] == "mask-trace"]
    assert traces[0] != traces[-1]  # the scores trained
    saved = torch.load(tmp_path / "run" / "checkpoints" / "dtp.pt", weights_only=True)
    trained = [len(group["params"]) for group in saved["optimizer"]["param_groups"]]
    weights = sum(1 for _ in summary["model"].parameters())
    assert trained == ([weights, 1] if train_weights else [0, 1])  # [model, pruner scores]


def test_fine_tuning_after_a_frozen_dtp_stage_trains_the_weights(tmp_path):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    settings = lm_recipe(model_dir, text, "prune.train_weights=false", "finetune.epochs=1")
    summary = run(settings, tmp_path / "run")
    pruned, dense = summary["model"].state_dict(), dense_weights(model_dir)
    assert not any(torch.equal(pruned[name], dense[name]) for name in NEVER_PRUNED)
    assert all(p.requires_grad for p in summary["model"].parameters())
    assert summary["perplexity"] < summary["perplexity_before_finetune"]


def test_bfloat16_weights_train_and_are_saved_in_bfloat16(tmp_path):
    """model.dtype bfloat16 with no autocast: every parameter and gradient is bfloat16,
    AdamW's two moments float32 (model.optimizer_state_dtype's default) and the
    compensation bfloat16, the loss is taken on float32 logits, the run trains, and
    from_pretrained reads the saved model as bfloat16."""
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    settings = lm_recipe(model_dir, text, "model.dtype=bfloat16", "run.amp=null")
    summary = run(settings, tmp_path / "run")
    assert {p.dtype for p in summary["model"].parameters()} == {torch.bfloat16}
    assert summary["perplexity"] < summary["dense_perplexity"]
    saved = torch.load(tmp_path / "run" / "checkpoints" / "finetune.pt", weights_only=True)
    states = saved["optimizer"]["state"].values()
    moments = [t for s in states for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    # updates below a weight's spacing are kept (compensated_optim.py)
    assert {s["compensation"].dtype for s in states} == {torch.bfloat16}
    config = json.loads((tmp_path / "run" / "pruned" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "pruned")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_bfloat16_fine_tuning_with_a_small_learning_rate_moves_the_weights(tmp_path, monkeypatch):
    """Fine-tuning bfloat16 weights at lr 1e-5 (AdamW steps of about 1e-5; half a
    bfloat16 spacing is about 6e-5 at the tiny Llama's typical weight of 0.02): the
    compensated updates move most weights from where the export left them; torch's
    AdamW, the control, leaves all but the smallest as they were."""
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    common = ["model.dtype=bfloat16", "prune.train_weights=false", "finetune.lr=1.0e-5"]
    common += ["finetune.warmup_steps=0", "finetune.epochs=3"]
    exported = run(lm_recipe(model_dir, text, *common, "finetune.epochs=0"))["model"]

    def moved(model) -> float:
        """The share of the weights that differ from the exported model's."""
        before = exported.state_dict()
        pairs = [(v, before[k]) for k, v in model.state_dict().items() if v.is_floating_point()]
        return sum(int((v != b).sum()) for v, b in pairs) / sum(v.numel() for v, _ in pairs)

    compensated = moved(run(lm_recipe(model_dir, text, *common))["model"])
    monkeypatch.setattr(
        train_module, "CompensatedAdamW", lambda *a, state_dtype, **k: torch.optim.AdamW(*a, **k)
    )
    plain = moved(run(lm_recipe(model_dir, text, *common))["model"])
    assert compensated > 0.5 and plain < 0.2, (compensated, plain)


def test_bfloat16_optimizer_state_is_held_in_bfloat16_when_asked(tmp_path):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    overrides = ["model.dtype=bfloat16", "model.optimizer_state_dtype=bfloat16"]
    overrides += ["prune.train_weights=false", "finetune.max_steps=2"]
    run(lm_recipe(model_dir, text, *overrides), tmp_path / "run")
    saved = torch.load(tmp_path / "run" / "checkpoints" / "finetune.pt", weights_only=True)
    states = saved["optimizer"]["state"].values()
    assert {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    with pytest.raises(RecipeError, match=r"model\.optimizer_state_dtype = 'bfloat16'.*needs"):
        lm_recipe(model_dir, text, "model.optimizer_state_dtype=bfloat16")


def test_bfloat16_and_frozen_keep_two_bytes_a_weight_in_the_dtp_stage(tmp_path):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    settings = lm_recipe(
        model_dir, text, "model.dtype=bfloat16", "prune.train_weights=false", "finetune.epochs=0"
    )
    summary = run(settings, tmp_path / "run")
    saved = torch.load(tmp_path / "run" / "checkpoints" / "dtp.pt", weights_only=True)
    weights = [t for name, t in saved["model"].items() if "rotary" not in name]
    assert {t.dtype for t in weights} == {torch.bfloat16}
    scores = saved["pruner"]["scores"]
    state = [t for s in saved["optimizer"]["state"].values() for k, t in s.items() if k != "step"]
    assert state and all(t.shape == scores.shape for t in state)  # the scores' moments alone
    dense = dense_weights(model_dir)
    for name in NEVER_PRUNED:
        assert torch.equal(summary["model"].state_dict()[name], dense[name].bfloat16()), name


def test_a_run_prunes_the_model_it_loaded_without_a_second_copy(tmp_path, monkeypatch):
    copied = []

    def deepcopy(value, *args):
        copied.append(type(value).__name__)
        return run_module.copy.deepcopy(value, *args)

    monkeypatch.setattr(run_module, "copy", types.SimpleNamespace(deepcopy=deepcopy))
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    summary = run(lm_recipe(model_dir, text, "prune.epochs=1", "finetune.epochs=0"), None)
    assert copied == []
    assert summary["params"] < sum(t.numel() for t in dense_weights(model_dir).values())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.dtype=float16"], r"model.dtype = 'float16'.* allowed"),
        (["run.amp=fp16", "model.dtype=bfloat16"], r"run.amp = 'fp16' .* model.dtype"),
        (["model.kwargs={dtype: bfloat16}"], r"model.kwargs.dtype .* as model.dtype"),
        (["model.kwargs={torch_dtype: bfloat16}"], r"model.kwargs.torch_dtype"),
        (["prune.train_weights=false", "prune.method=l1"], r"prune.train_weights = false"),
        (
            ["prune.train_weights=false", "prune.granularity=weight", "prune.scores=magnitude"],
            r"needs prune.method = 'dtp' with prune.scores = 'learned'",
        ),
        (["prune.train_weights=0"], r"prune.train_weights"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_field(tmp_path, overrides, message):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    with pytest.raises(RecipeError, match=message):
        run(lm_recipe(model_dir, text, *overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


def test_bfloat16_is_refused_for_a_model_the_recipe_builds():
    with pytest.raises(RecipeError, match=r"model.dtype = 'bfloat16' .* needs model.source"):
        recipe.load(None, ["model.dtype=bfloat16"])


def test_the_loss_of_bfloat16_logits_is_taken_in_float32():
    from dtp_kernels.pipeline.step import training_step

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1000).bfloat16()
    inputs, labels = torch.randn(64, 16).bfloat16(), torch.randint(0, 1000, (64,))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(inputs).float(), labels)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = training_step(model, optimizer, inputs, labels)
    assert loss.dtype == torch.float32 and torch.equal(loss, expected)


def test_a_hugging_face_image_classifier_trains_in_bfloat16(tmp_path):
    """Images stay float32 in the loader; the model takes them into its bfloat16 layers."""
    from test_model_source import prune_classifier

    _, summary = prune_classifier(tmp_path, "vit", "{heads: 0.5}", "model.dtype=bfloat16")
    assert {p.dtype for p in summary["model"].parameters()} == {torch.bfloat16}
    assert summary["accuracy"] > summary["dense_accuracy"] + 0.05  # it trained


def test_in_your_own_loop_the_masks_learn_with_the_weights_frozen():
    """docs/pruning.md: requires_grad_(False), an optimizer over the pruner's scores
    alone, attach(); the weights stay as they were, the scores and state move."""
    from dtp_kernels import DTPPruner
    from utils import tiny_llama

    model = tiny_llama(vocab=256)
    model.requires_grad_(False)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    pruner = DTPPruner(model, tokens[:1], {"heads": 0.5, "mlp": 0.5})
    weights = list(model.parameters())
    assert not any(w.requires_grad for w in weights)  # frozen again after the tracing
    before = [w.detach().clone() for w in weights]
    scores = [p.detach().clone() for p in pruner.parameters()]
    optimizer = torch.optim.AdamW(pruner.parameters(), lr=0.01)
    pruner.attach(optimizer)
    for _ in range(3):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:]).backward()
        optimizer.step()
    assert all(torch.equal(w, b) for w, b in zip(weights, before, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(scores, pruner.parameters(), strict=True))
    assert int(pruner.state.steps) == 3
    small = pruner.export()
    assert small.config.intermediate_size == 24
