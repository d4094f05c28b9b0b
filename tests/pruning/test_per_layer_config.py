"""Configs that hold sizes per layer (transformers' heterogeneous configs: Gemma 4's
full-attention layers have their own head_dim in `per_layer_config`): the export's sizes
are written layer by layer where one size for all cannot describe them, in the model's
config or a composite model's text config (Gemma 4's vision-language model), and the
saved model loads with `from_pretrained` and generates as the exported one does; sizes
the model's code reads once for all layers (Gemma 4's MLP width) still warn and leave
the config as it was."""

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from utils import described_export, hard_masked_and_exported, randomised, tiny_gemma_sharing_kv

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
LAYER_TYPES = ["sliding_attention", "full_attention"]


def gemma4_text_config(**sizes) -> dict:
    """Two sliding-window layers of head_dim 16 and a full-attention one of 32 (`sizes`
    over them)."""
    return (
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            vocab_size_per_layer_input=256,
            hidden_size_per_layer_input=16,
            sliding_window=8,
            max_position_embeddings=128,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
        | sizes
    )


def gemma4():
    config = transformers.Gemma4TextConfig(**gemma4_text_config())
    torch.manual_seed(0)
    return transformers.Gemma4ForCausalLM(config).eval()


def test_gemma4_exports_with_per_layer_head_dims_and_round_trips(tmp_path):
    model = gemma4()
    pruner = randomised(DTPPruner(model, (TOKENS,), 0.5))
    kinds = sorted({type(g).__name__ for g in pruner.groups})
    assert kinds == ["ChannelGroup", "HeadGroup"]
    exported, got = described_export(pruner, model, (TOKENS,))
    config = exported.config
    config.allow_global_per_layer_attribute_access = True
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.intermediate_size == 64
    layers = [config.per_layer_config[i] for i in range(3)]
    assert [c.head_dim for c in layers] == [16, 16, 32]  # the full layer's own, kept
    exported.save_pretrained(tmp_path)
    loaded = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, got)
    want_tokens = exported.generate(TOKENS[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(loaded.generate(TOKENS[:1], max_new_tokens=4, do_sample=False), want_tokens)


def test_gemma4_mlp_widths_differing_by_layer_warn_and_keep_the_config():
    """Gemma 4's code reads the MLP width once for all layers: the layers' own widths
    cannot be written, so the export warns and its config is the model's."""
    model = gemma4()
    before = model.config.to_dict()
    ratios = {"mlp": 0.5, "model.layers.1.mlp.gate_proj": 0.75}
    pruner = randomised(DTPPruner(model, (TOKENS,), ratios))
    with pytest.warns(UserWarning, match=r"config cannot describe its sizes"):
        exported, got, want = hard_masked_and_exported(pruner, model, (TOKENS,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert exported.config.to_dict() == before
    widths = [layer.mlp.gate_proj.out_features for layer in exported.model.layers]
    assert widths == [64, 32, 64]


def test_gemma4_vision_language_model_writes_its_text_config_per_layer(tmp_path):
    """The composite model's language model is pruned (text inputs: the vision tower is
    not run, so it stays whole); its `text_config` gets the sizes, the full-attention
    layer's head_dim kept, and the saved model loads and computes the same logits."""
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        position_embedding_size=64,
        pooling_kernel_size=2,
    )
    special = {  # the image, video and audio tokens' ids, inside the small vocabulary
        "boi_token_id": 250,
        "eoi_token_id": 251,
        "image_token_id": 252,
        "video_token_id": 253,
        "boa_token_id": 254,
        "eoa_token_index": 255,
        "audio_token_id": 249,
    }
    config = transformers.Gemma4Config(
        text_config=gemma4_text_config(num_hidden_layers=2, layer_types=LAYER_TYPES),
        vision_config=vision,
        audio_config=None,
        **special,
    )
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with pytest.warns(UserWarning, match=r"not called on example_inputs"):
        pruner = randomised(DTPPruner(model, (TOKENS,), 0.5))
    assert all(g.name.startswith("model.language_model.") for g in pruner.groups)
    exported, got = described_export(pruner, model, (TOKENS,))
    text = exported.config.text_config
    assert [text.per_layer_config[i].head_dim for i in range(2)] == [16, 32]
    exported.save_pretrained(tmp_path)
    loaded = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, got)


def test_mlp_widths_held_per_layer_are_written_layer_by_layer(tmp_path):
    """Gemma 3n holds one MLP width per layer (`intermediate_size` a list): its first
    layer's MLP, whose activation sparsity reads all its neurons' statistics, stays whole
    while the others lose half; the config gets each layer's width, and the export
    (heads of layers sharing keys and values too) round-trips through save_pretrained."""
    model = tiny_gemma_sharing_kv("gemma3n", sparsity=0.95)
    ratios = {"heads": 0.5, "*.mlp.gate_proj": 0.5}
    pruner = randomised(DTPPruner(model, (TOKENS,), ratios))
    assert "model.layers.0.mlp.gate_proj" not in {g.name for g in pruner.groups}
    exported, got = described_export(pruner, model, (TOKENS,))
    assert exported.config.intermediate_size == [128, 64, 64, 64]
    exported.save_pretrained(tmp_path)
    loaded = transformers.Gemma3nForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, got, rtol=0, atol=0)


def test_a_low_rank_residual_rank_is_written(tmp_path):
    """Gemma 3n's learned augmented residual (laurel: linear_left to laurel_rank, then
    linear_right back) prunes its rank like an MLP's width: the config gets the kept rank
    and the export round-trips through save_pretrained. (Its AltUp router's outputs, one
    per AltUp input, have no field of their own: left whole here.)"""
    model = tiny_gemma_sharing_kv("gemma3n", sparsity=0.95)
    ratios = {"*.altup.modality_router": 0, "*": 0.5}
    pruner = randomised(DTPPruner(model, (TOKENS,), ratios))
    assert sum(g.name.endswith("laurel.linear_left") for g in pruner.groups) == 4
    exported, got = described_export(pruner, model, (TOKENS,))
    assert exported.config.laurel_rank == 4
    assert exported.model.layers[0].laurel.linear_right.in_features == 4
    exported.save_pretrained(tmp_path)
    loaded = transformers.Gemma3nForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, got, rtol=0, atol=0)


def test_the_warning_names_the_layers_no_config_field_describes():
    """With its AltUp routers pruned too (a float ratio), Gemma 3n's config has no field
    for their outputs: the export warns, naming the AltUp layers whose shapes a model
    built from the updated config would not have, and keeps the config as it was."""
    model = tiny_gemma_sharing_kv("gemma3n", sparsity=0.95)
    before = model.config.to_dict()
    pruner = randomised(DTPPruner(model, (TOKENS,), 0.5))
    with pytest.warns(UserWarning, match=r"config cannot describe") as caught:
        exported = pruner.export()
    message = str(next(w.message for w in caught if "cannot describe" in str(w.message)))
    assert "['model.layers.0.altup.correction_coefs', 'model.layers.0.altup." in message
    assert "'model.layers.0.altup.modality_router'" in message
    assert exported.config.to_dict() == before
