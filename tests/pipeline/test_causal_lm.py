"""`dtp prune` on a Hugging Face causal language model (data.name text, model.source
huggingface): a tiny Llama (and GPT-2, OLMo 2, Mamba-2, Qwen3.5, Gemma 4, Kimi Linear,
Mixtral) saved here with save_pretrained, text written here, nothing downloaded. The
pruned model is saved with save_pretrained, loads with from_pretrained at the exact kept
counts, and the summary's perplexity is that model's."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from dtp_kernels.cli import main
from dtp_kernels.pipeline import recipe
from dtp_kernels.pipeline.errors import RecipeError, UsageError
from dtp_kernels.pipeline.plan import plan
from dtp_kernels.pipeline.run import build_data, run
from dtp_kernels.pipeline.train import make_optimizer
from utils import (
    tiny_deepseek_v4,
    tiny_gemma_sharing_kv,
    tiny_kimi_linear,
    tiny_llama,
    tiny_mixtral,
)

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parents[2] / "dtp_kernels" / "configs"
SEQ = 32


def save_llama(where: Path, vocab: int = 256) -> Path:
    """A tiny Llama (4 heads, 2 key/value heads, MLP 48) saved with save_pretrained."""
    tiny_llama(vocab=vocab).save_pretrained(where)
    return where


def write_text(where: Path, train_bytes: int = 12000, val_bytes: int = 3000) -> Path:
    """train.txt and val.txt: Python source of the standard library (ASCII)."""
    source = b""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source += path.read_bytes().decode("ascii", "ignore").encode()
        if len(source) >= train_bytes + val_bytes:
            break
    where.mkdir(parents=True, exist_ok=True)
    (where / "train.txt").write_bytes(source[:train_bytes])
    (where / "val.txt").write_bytes(source[train_bytes : train_bytes + val_bytes])
    return where


def torchrun_language_model(out: Path, sets: list[str]) -> dict:
    """`dtp prune` of configs/causal_lm.yaml with `sets` into `out` under torchrun, 2
    processes of one thread; its summary."""
    import subprocess
    import sys

    from utils import ROOT, checkout_environment

    argv = ["prune", "--config", str(CONFIGS / "causal_lm.yaml"), "--out", str(out)]
    command = [
        sys.executable,
        *["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
        *["-m", "dtp_kernels", *argv, "--no-progress"],
        *[a for s in sets for a in ("--set", s)],
    ]
    env = checkout_environment(OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def lm_overrides(model: Path, text: Path) -> list[str]:
    """configs/causal_lm.yaml set for the tiny model and text, fp32 on the CPU."""
    return [
        f"model.path={model}",
        f"data.root={text}",
        "data.tokenizer=bytes",
        f"data.seq_len={SEQ}",
        "run.amp=null",
        "run.device=cpu",
        "run.progress=false",
        "prune.lr=0.003",
        "finetune.lr=0.003",
    ]


def lm_recipe(model: Path, text: Path, *overrides: str) -> dict:
    return recipe.load(CONFIGS / "causal_lm.yaml", [*lm_overrides(model, text), *overrides])


def blocks(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(list(path.read_bytes()))
    count = (len(ids) - 1) // SEQ
    return ids[: count * SEQ].view(count, SEQ), ids[1 : count * SEQ + 1].view(count, SEQ)


def stacked(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block of a text data set: inputs and targets, stacked."""
    inputs, targets = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(inputs), torch.stack(targets)


def test_prune_command_prunes_a_causal_lm_and_saves_it_for_from_pretrained(tmp_path):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    out = tmp_path / "run"
    sets = [a for s in lm_overrides(model_dir, text) for a in ("--set", s)]
    argv = ["prune", "--config", str(CONFIGS / "causal_lm.yaml"), "--out", str(out)]
    assert main([*argv, *sets]) == 0
    summary = json.loads((out / "summary.json").read_text())
    heads = [g for g in summary["groups"] if g["name"].endswith("self_attn")]
    mlps = [g for g in summary["groups"] if g["name"].endswith("gate_proj")]
    assert [(g["n"], g["k"]) for g in heads] == [(2, 1)] * 2  # key/value heads
    assert [(g["n"], g["k"]) for g in mlps] == [(48, 24)] * 2
    pruned = transformers.AutoModelForCausalLM.from_pretrained(out / "pruned").eval()
    config = pruned.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.intermediate_size == 24
    assert sum(p.numel() for p in pruned.parameters()) == summary["params"]
    # the summary's perplexity and next-token accuracy are the saved model's on val.txt
    inputs, targets = blocks(text / "val.txt")
    with torch.no_grad():
        logits = pruned(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert summary["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
    accuracy = float((logits.argmax(-1) == targets).float().mean())
    assert summary["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    for key in ("dense_perplexity", "perplexity_before_finetune"):
        assert math.isfinite(summary[key]) and summary[key] > 1
    assert summary["perplexity"] < summary["dense_perplexity"]  # it trained on the text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["stage"].startswith("finetune")][-1]
    assert last["perplexity"] == pytest.approx(summary["perplexity"], rel=1e-6)


def llama_with_word_tokenizer(where: Path, text: Path):
    """A tiny Llama saved with its own tokenizer (WordLevel over the words of the text,
    built here); the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(
        set((text / "train.txt").read_text().split()) | set((text / "val.txt").read_text().split())
    )
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    save_llama(where, vocab=len(vocab))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tokenizer.save_pretrained(where)
    return tokenizer


def test_the_models_own_tokenizer_reads_the_text_and_is_saved_with_it(tmp_path):
    text = write_text(tmp_path / "text")
    model_dir = tmp_path / "llama"
    tokenizer = llama_with_word_tokenizer(model_dir, text)
    settings = lm_recipe(model_dir, text, "data.tokenizer=model", "prune.method=l1")
    settings["data"]["seq_len"] = 16
    _, test_loader = build_data(settings, vocab_size=len(tokenizer))
    ids = tokenizer((text / "val.txt").read_text(), add_special_tokens=False)["input_ids"]
    inputs, targets = stacked(test_loader.dataset)
    assert inputs[0].tolist() == ids[:16] and targets[0].tolist() == ids[1:17]
    assert len(inputs) == (len(ids) - 1) // 16
    settings["pretrain"].update(epochs=1, optimizer="adamw", lr=0.003)
    summary = run(settings, tmp_path / "run")
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    pretrained = [json.loads(r) for r in rows if json.loads(r)["stage"] == "pretrain"][-1]
    assert summary["dense_perplexity"] == pytest.approx(pretrained["perplexity"], rel=1e-6)
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "pruned")
    assert saved("def return")["input_ids"] == tokenizer("def return")["input_ids"]


def test_layers_of_different_sizes_are_saved_as_a_module_with_the_tokenizer(tmp_path):
    """The two MLPs keep 24 and 12 of 48 neurons: the config's one intermediate_size
    cannot describe that and save_pretrained's files would not load, so the run writes
    pruned.pt (a pickled module) and the tokenizer to tokenizer/."""
    from dtp_kernels import load_pruned

    text = write_text(tmp_path / "text")
    model_dir = tmp_path / "llama"
    tokenizer = llama_with_word_tokenizer(model_dir, text)
    ratios = "prune.ratios={mlp: 0.5, model.layers.1.mlp.gate_proj: 0.75}"
    settings = lm_recipe(model_dir, text, "data.tokenizer=model", ratios, "data.seq_len=16")
    # known before training: the plan says it, and the run warns at its start
    # (no ratios keep save_pretrained but the MLPs whole: none are advised)
    assert plan(settings)["saved"] == {"saved": "pruned.pt", "ratios_for_save_pretrained": None}
    with pytest.warns(UserWarning, match=r"save_pruned \(the run writes it to pruned.pt\)"):
        summary = run(settings, tmp_path / "run")
    assert [(g["n"], g["k"]) for g in summary["groups"]] == [(48, 24), (48, 12)]
    assert summary["saved"] == "pruned.pt"
    assert not (tmp_path / "run" / "pruned").exists()
    pruned = load_pruned(tmp_path / "run" / "pruned.pt", trusted=True).eval()
    assert [layer.mlp.down_proj.in_features for layer in pruned.model.layers] == [24, 12]
    assert sum(p.numel() for p in pruned.parameters()) == summary["params"]
    _, test_loader = build_data(settings, vocab_size=len(tokenizer))
    inputs, targets = stacked(test_loader.dataset)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(pruned(inputs).logits.transpose(1, 2), targets)
    assert summary["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "tokenizer")
    assert saved("def return")["input_ids"] == tokenizer("def return")["input_ids"]


def save_gpt2(where: Path, vocab: int = 256) -> Path:
    """A tiny GPT-2 (transformers' Conv1D layers; 4 heads, MLP 64) saved with
    save_pretrained."""
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_inner=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(where)
    return where


def test_prune_command_prunes_gpt2_and_saves_it_in_its_own_layout(tmp_path):
    """GPT-2's Conv1D layers are taken as nn.Linear to prune and put back at export:
    with its MLPs pruned the run saves it with save_pretrained and GPT2LMHeadModel loads
    it at the kept width; with its heads too (a head size its config cannot describe)
    it goes to pruned.pt, Conv1D layers and all."""
    from dtp_kernels import load_pruned

    model_dir, text = save_gpt2(tmp_path / "gpt2"), write_text(tmp_path / "text")
    settings = lm_recipe(model_dir, text, "prune.ratios={mlp: 0.5}")
    assert plan(settings)["saved"] == {"saved": "pruned", "ratios_for_save_pretrained": None}
    summary = run(settings, tmp_path / "mlp")
    assert summary["saved"] == "pruned"
    pruned = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "mlp" / "pruned")
    assert pruned.config.n_inner == 32 and pruned.transformer.h[0].mlp.c_fc.nf == 32
    assert sum(p.numel() for p in pruned.parameters()) == summary["params"]
    settings = lm_recipe(model_dir, text)
    # the plan gives the ratios that would keep save_pretrained: the heads whole
    advice = {"heads": 0, "mlp": 0.5}
    assert plan(settings)["saved"] == {"saved": "pruned.pt", "ratios_for_save_pretrained": advice}
    with pytest.warns(UserWarning, match=r"ratios=\{'heads': 0, 'mlp': 0.5\} keep save_pretr"):
        summary = run(settings, tmp_path / "both")
    assert summary["saved"] == "pruned.pt"
    pruned = load_pruned(tmp_path / "both" / "pruned.pt", trusted=True)
    attention = pruned.transformer.h[0].attn
    assert type(attention.c_attn).__name__ == "Conv1D" and attention.num_heads == 2


def save_lm(where: Path, config: str, model: str, vocab: int, **sizes) -> Path:
    """transformers' `{model}ForCausalLM` of a `{config}Config` (4 heads, 2 key/value
    heads, MLPs of 48, and `sizes`) saved with save_pretrained."""
    built = getattr(transformers, f"{config}Config")(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        **sizes,
    )
    torch.manual_seed(0)
    getattr(transformers, f"{model}ForCausalLM")(built).save_pretrained(where)
    return where


def save_olmo2(where: Path, vocab: int = 256) -> Path:
    """A tiny OLMo 2 (q_norm and k_norm over all heads)."""
    return save_lm(where, "Olmo2", "Olmo2", vocab, num_hidden_layers=2)


def save_mamba2(where: Path, vocab: int = 256) -> Path:
    """A tiny Mamba-2 (2 mixers of 8 heads in 2 groups)."""
    from utils import tiny_mamba2

    model = tiny_mamba2()
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(where)
    return where


def save_qwen3_5(where: Path, vocab: int = 256) -> Path:
    """A tiny Qwen3.5: 3 Gated DeltaNet layers (4 key heads, 8 value heads) and a gated
    attention layer."""
    linear = dict(
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    return save_lm(
        where, "Qwen3_5Text", "Qwen3_5", vocab, head_dim=8, num_hidden_layers=4, **linear
    )


def save_gemma4(where: Path, vocab: int = 256) -> Path:
    """A tiny Gemma 4: a sliding-window layer of head_dim 8 and a full-attention layer
    of 16, its own per layer in the config (`per_layer_config`)."""
    return save_lm(
        where,
        "Gemma4Text",
        "Gemma4",
        vocab,
        head_dim=8,
        global_head_dim=16,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size_per_layer_input=vocab,
        hidden_size_per_layer_input=8,
        sliding_window=8,
    )


def save_gemma4_sharing_kv(where: Path, vocab: int = 256) -> Path:
    """A tiny Gemma 4 (tests/utils.py) whose last 2 of 4 layers read the keys and values
    of the first 2."""
    tiny_gemma_sharing_kv("gemma4", vocab=vocab).save_pretrained(where)
    return where


def save_kimi_linear(where: Path, vocab: int = 256) -> Path:
    """A tiny Kimi Linear (tests/utils.py): a Kimi Delta Attention layer and a latent
    attention layer with experts."""
    tiny_kimi_linear(vocab=vocab, layers=2).save_pretrained(where)
    return where


def save_deepseek_v4(where: Path, vocab: int = 256) -> Path:
    """A tiny DeepSeek-V4 (tests/utils.py): multi-query attention whose output projection
    is block-diagonal over 2 groups of 4 heads."""
    tiny_deepseek_v4(vocab=vocab).save_pretrained(where)
    return where


LINEAR_AND_GATED = "prune.ratios={heads: 0.5, linear_attention: 0.5, mlp: 0.5}"


@pytest.mark.parametrize(
    "save, ratios, saved",
    [
        (save_olmo2, [], "pruned"),
        (save_mamba2, ["prune.ratios={mamba: 0.5}"], "pruned.pt"),
        (save_qwen3_5, [LINEAR_AND_GATED], "pruned"),
        (save_gemma4, [], "pruned"),
        (save_kimi_linear, ["prune.ratios={heads: 0.5, linear_attention: 0.5}"], "pruned"),
        (save_deepseek_v4, ["prune.ratios={heads: 0.5}"], "pruned"),
        (save_gemma4_sharing_kv, [], "pruned"),
    ],
    ids=["olmo2", "mamba2", "qwen3_5", "gemma4", "kimi_linear", "deepseek_v4", "gemma4_kv"],
)
def test_prune_command_prunes_norms_over_all_heads_and_recurrent_mixers(
    save, ratios, saved, tmp_path
):
    """OLMo 2's heads with their norms over all heads (its config describes the export:
    save_pretrained), Mamba-2 mixers' heads (each norm's epsilon its own: pruned.pt),
    Qwen3.5's linear-attention and gated-attention heads, Gemma 4's heads and MLPs (its
    config per layer), Kimi Linear's delta-attention heads (save_pretrained) and
    DeepSeek-V4's heads (as many kept in each group of its grouped output projection)
    and those of Gemma 4's layers sharing keys and values prune end to end; the saved
    model computes the summary's perplexity."""
    from dtp_kernels import load_pruned

    model_dir, text = save(tmp_path / "model"), write_text(tmp_path / "text")
    summary = run(lm_recipe(model_dir, text, *ratios), tmp_path / "run")
    assert summary["saved"] == saved
    assert all(g["k"] == g["n"] // 2 for g in summary["groups"])
    if saved == "pruned":
        pruned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / saved)
    else:
        pruned = load_pruned(tmp_path / "run" / saved, trusted=True)
    inputs, targets = blocks(text / "val.txt")
    with torch.no_grad():
        logits = pruned.eval()(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert summary["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
    assert summary["perplexity"] < summary["dense_perplexity"]


@pytest.mark.slow
def test_a_compiled_dtp_stage_of_a_causal_lm_matches_eager_without_graph_breaks(tmp_path):
    """run.compile on a transformers Llama: the DTP stage's step compiles whole (the
    pruner's hooks, the attention and the loss; no graph break) and trains as eager."""
    from torch._dynamo.utils import counters

    model_dir = save_llama(tmp_path / "llama")
    text = write_text(tmp_path / "text", train_bytes=SEQ * 16 * 4 + 1)  # 4 batches of 16
    summaries, graphs, breaks = {}, {}, {}
    for compiled in (False, True):
        before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        settings = lm_recipe(
            model_dir,
            text,
            f"run.compile={str(compiled).lower()}",
            "prune.epochs=1",
            "finetune.epochs=0",
            "data.batch_size=16",
        )
        summaries[compiled] = run(settings, tmp_path / f"run-{compiled}")
        graphs[compiled] = counters["stats"]["unique_graphs"] - before[0]
        breaks[compiled] = sum(counters["graph_break"].values()) - before[1]
    assert graphs[False] == 0 and graphs[True] >= 1 and breaks[True] == 0
    eager, compiled = summaries[False], summaries[True]
    kept = [[(g["name"], g["n"], g["k"]) for g in s["groups"]] for s in (eager, compiled)]
    assert kept[0] == kept[1]
    assert compiled["perplexity"] == pytest.approx(eager["perplexity"], rel=1e-5)


def test_activation_checkpointing_trains_as_without_it(tmp_path):
    """run.activation_checkpointing: the layers run under transformers' non-reentrant
    checkpointing in every stage, and the run ends where the run without it ends."""
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    summaries = {}
    for on in (False, True):
        settings = lm_recipe(model_dir, text, f"run.activation_checkpointing={str(on).lower()}")
        summaries[on] = run(settings, tmp_path / f"run-{on}")
    checkpointed = [
        getattr(m, "gradient_checkpointing", False) for m in summaries[True]["model"].modules()
    ]
    assert any(checkpointed)  # the exported model, fine-tuned, still checkpoints
    for key in ("perplexity_before_finetune", "perplexity"):
        assert summaries[True][key] == pytest.approx(summaries[False][key], rel=1e-5)


def test_activation_checkpointing_is_refused_where_it_cannot_run():
    from dtp_kernels.pipeline.model_source import checkpoint_activations
    from utils import DIGITS_RECIPE

    with pytest.raises(RecipeError, match=r"run.activation_checkpointing = true .* needs model"):
        recipe.load(DIGITS_RECIPE, ["run.activation_checkpointing=true"])
    with pytest.raises(UsageError, match=r"true needs a Hugging Face model.* Linear"):
        checkpoint_activations(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (["model.source=builtin", "model.path=null"], RecipeError, r"needs model.source"),
        (["model.path=null"], RecipeError, r"model.source = 'huggingface' needs model.path"),
        (["model.weights=dense.pt"], RecipeError, r"read from model.path"),
        (["run.channels_last=true"], RecipeError, r"channels_last is for images"),
        (["prune.optimizer=adam"], RecipeError, r"prune.optimizer = 'adam'"),
        (["model.path={empty}"], FileNotFoundError, r"no config.json there"),
        (["data.root={empty}"], FileNotFoundError, r"has no train.txt or val.txt"),
        (["data.seq_len=4000"], UsageError, r"val.txt holds 3000 tokens, fewer than"),
        (["model.path={small}"], UsageError, r"token id \d+ .* vocabulary of 100"),
        (["data.tokenizer=model"], UsageError, r"no tokenizer could be read from model.path"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_field(tmp_path, overrides, error, message):
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    places = {
        "empty": tmp_path / "empty",
        "small": save_llama(tmp_path / "small", vocab=100),
    }
    places["empty"].mkdir()
    overrides = [o.format(**places) for o in overrides]
    with pytest.raises(error, match=message):
        run(lm_recipe(model_dir, text, *overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "pruned").exists()


@pytest.mark.parametrize(("kind", "cls"), [("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)])
def test_each_stage_names_its_optimizer(kind, cls):
    model = torch.nn.Linear(3, 2)
    settings = {"optimizer": kind, "lr": 0.01, "momentum": 0.9, "weight_decay": 0.1}
    optimizer = make_optimizer(model, settings)
    assert type(optimizer) is cls and optimizer.defaults["weight_decay"] == 0.1


def test_whole_experts_of_a_mixtral_through_the_command_line(tmp_path):
    """{whole_experts: 0.5} on a saved Mixtral (8 experts, top-2): the saved config holds
    4 experts per block and from_pretrained builds the pruned model from it."""
    tiny_mixtral(vocab=256).save_pretrained(tmp_path / "mixtral")
    text = write_text(tmp_path / "text")
    settings = lm_recipe(tmp_path / "mixtral", text, "prune.ratios={whole_experts: 0.5}")
    summary = run(settings, tmp_path / "run")
    assert [(g["n"], g["k"]) for g in summary["groups"]] == [(8, 4)] * 2
    pruned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "pruned")
    assert pruned.config.num_local_experts == 4
    inputs, targets = blocks(text / "val.txt")
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(
            pruned.eval()(inputs).logits.flatten(0, 1), targets.flatten()
        )
    assert summary["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
