"""Attention heads of the Hugging Face families beyond Llama, BERT and Phi-3 (tiny
configurations built here, nothing downloaded): separate projections under other names,
GPT-2's fused c_attn once its Conv1D layers are made nn.Linear, cross-attention and
per-head position-bias tables; the fused forms no recognised one covers are left whole
while their MLPs prune, and what cannot be pruned is refused by name. For each: the
heads are groups, the export keeps exactly the heads asked for and computes what the
hard-masked model computes, and the config follows when it can describe the pruned
model."""

import ast
import math
import warnings

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.attention_forms import match_form
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.heads import HeadGroup
from dtp_kernels.pruning.refusals import zero_ratios
from utils import LLAMA_VOCAB as VOCAB
from utils import (
    TINY_BERT,
    TINY_HF_VIT,
    described_export,
    randomised,
    tiny_dbrx,
    tiny_deepseek,
    tiny_deepseek_v4,
    tiny_speech_encoder,
    tiny_t5,
)

transformers = pytest.importorskip("transformers")
from dtp_kernels.pruning.transformers_attention import (  # noqa: E402
    PrunedWav2Vec2ConformerSelfAttention,
)

TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tokens(batch=2, length=9, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# the sizes shared by the decoder-only language models, and by the encoder-decoders
DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, **TOKEN_IDS
)
SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    **TOKEN_IDS,
)


def decoder(family: str, layers: int = 2, model: str | None = None, **sizes):
    """A tiny `{model or family}ForCausalLM` built from a `{family}Config` of `layers`
    layers and the shared sizes."""
    config = getattr(transformers, f"{family}Config")(num_hidden_layers=layers, **DECODER, **sizes)
    return getattr(transformers, f"{model or family}ForCausalLM")(config), (tokens(),)


def distilbert():
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4, pad_token_id=0
    )
    return transformers.DistilBertForSequenceClassification(config), (tokens(),)


def albert():  # query, key, value and dense in one module, its LayerNorm after dense
    config = transformers.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        pad_token_id=0,
    )
    return transformers.AlbertForSequenceClassification(config), (tokens(),)


def deberta(share_att_key: bool = False, family: str = "DebertaV2", **options):
    """A tiny DeBERTa-v2 (or DeBERTa: `family="Deberta"`) classifier with relative
    attention: pos_key_proj and pos_query_proj (DeBERTa's pos_proj and pos_q_proj)."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=16,
        share_att_key=share_att_key,
        **options,
        **TOKEN_IDS,
    )
    return getattr(transformers, f"{family}ForSequenceClassification")(config), (tokens(),)


def bart():  # encoder self-attention, decoder self- and cross-attention
    config = transformers.BartConfig(decoder_start_token_id=2, forced_eos_token_id=2, **SEQ2SEQ)
    return transformers.BartForConditionalGeneration(config), (tokens(),)


def whisper():  # input features and decoder tokens; attention_mask left None
    config = transformers.WhisperConfig(
        num_mel_bins=8,
        max_source_positions=8,
        max_target_positions=16,
        decoder_start_token_id=1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        **SEQ2SEQ,
    )
    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2))
    return transformers.WhisperForConditionalGeneration(config), (features, None, tokens(2, 5))


def clip_vision():
    config = transformers.CLIPVisionConfig(**TINY_HF_VIT)
    return transformers.CLIPVisionModel(config), (torch.randn(2, 3, 16, 16),)


def dinov2(registers: bool = False):  # the ViT layout; layer scale; registers
    if registers:
        config = transformers.Dinov2WithRegistersConfig(**TINY_HF_VIT, num_register_tokens=2)
        return transformers.Dinov2WithRegistersModel(config), (torch.randn(2, 3, 16, 16),)
    config = transformers.Dinov2Config(**TINY_HF_VIT)
    return transformers.Dinov2Model(config), (torch.randn(2, 3, 16, 16),)


def siglip_vision():  # its attention-pooling head: test_vision_language.py
    config = transformers.SiglipVisionConfig(**TINY_HF_VIT, vision_use_head=False)
    return transformers.SiglipVisionModel(config), (torch.randn(2, 3, 16, 16),)


def gptj():
    config = transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_inner=64, **TOKEN_IDS
    )
    return transformers.GPTJForCausalLM(config), (tokens(),)


def ctrl():  # Wq, Wk, Wv and dense
    config = transformers.CTRLConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, dff=64)
    return transformers.CTRLLMHeadModel(config), (tokens(),)


def xlm(family: str = "XLM"):  # q_lin, k_lin, v_lin and out_lin; a cache made always
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4
    )
    return getattr(transformers, f"{family}WithLMHeadModel")(config), (tokens(),)


def opt(word_embed_proj_dim: int = 32):  # its MLP width is ffn_dim
    sizes = {k: v for k, v in DECODER.items() if k != "intermediate_size"}
    config = transformers.OPTConfig(
        num_hidden_layers=2, ffn_dim=64, word_embed_proj_dim=word_embed_proj_dim, **sizes
    )
    return transformers.OPTForCausalLM(config), (tokens(),)


def gpt_neox_japanese():
    """Its last attention layer returns `dense_bias` (the model width, here as wide as
    the query width) for its block to add after the output projection."""
    config = transformers.GPTNeoXJapaneseConfig(
        num_hidden_layers=2, intermediate_multiple_size=2, **DECODER
    )
    model = transformers.GPTNeoXJapaneseForCausalLM(config)
    with torch.no_grad():  # zeros as built: a bias cut with the heads would pass unseen
        model.gpt_neox_japanese.layers[1].attention.dense_bias.normal_()
    return model, (tokens(),)


# these reshape their attention output to their own embed_dim, not to -1
def xglm():
    config = transformers.XGLMConfig(
        vocab_size=VOCAB, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4, **TOKEN_IDS
    )
    return transformers.XGLMForCausalLM(config), (tokens(),)


def mvp():
    config = transformers.MvpConfig(decoder_start_token_id=2, forced_eos_token_id=2, **SEQ2SEQ)
    return transformers.MvpForConditionalGeneration(config), (tokens(),)


def internvl_vision():  # its output projection is projection_layer
    config = transformers.InternVLVisionConfig(**TINY_HF_VIT)
    return transformers.InternVLVisionModel(config), (torch.randn(2, 3, 16, 16),)


# the ViT layout: the inner layer named `attention` beside `output.dense`
def data2vec_vision():  # with a relative position bias table per layer
    config = transformers.Data2VecVisionConfig(use_relative_position_bias=True, **TINY_HF_VIT)
    return transformers.Data2VecVisionForImageClassification(config), (torch.randn(2, 3, 16, 16),)


def yolos():  # detection tokens beside the patches
    config = transformers.YolosConfig(
        num_detection_tokens=4, **(TINY_HF_VIT | {"image_size": [16, 16]})
    )
    return transformers.YolosModel(config), (torch.randn(2, 3, 16, 16),)


def mobilevit():  # attention layers between convolutions, three stages
    config = transformers.MobileViTConfig(
        image_size=64,
        hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
        num_attention_heads=4,
        num_labels=5,
    )
    return transformers.MobileViTForImageClassification(config), (torch.randn(2, 3, 64, 64),)


WIDTH_REWRITTEN = ("xglm", "mvp", "internvl_vision")
NORMS_OVER_ALL_HEADS = ("olmo2", "olmo2_mha", "olmo3")  # q_norm and k_norm


GQA = {"num_key_value_heads": 2, "head_dim": 8}

# family: (builder, attention layers, units per layer, whether the config can describe
# the pruned model; those whose head size follows from hidden_size / heads cannot)
FAMILIES = {
    "distilbert": (distilbert, 2, 4, False),
    # one layer shared by both of the model's layers: one group
    "albert": (albert, 1, 4, False),
    "deberta_v3": (lambda: deberta(share_att_key=True), 2, 4, False),
    "deberta_pos_proj": (lambda: deberta(share_att_key=False), 2, 4, False),
    "opt": (opt, 2, 4, False),
    "bart": (bart, 3, 4, False),
    "clip_vision": (clip_vision, 2, 4, False),
    "siglip_vision": (siglip_vision, 2, 4, False),
    "dinov2": (dinov2, 2, 4, False),
    "dinov2_registers": (lambda: dinov2(registers=True), 2, 4, False),
    "gptj": (gptj, 2, 4, False),
    "ctrl": (ctrl, 2, 4, False),
    "xlm": (xlm, 2, 4, False),
    "flaubert": (lambda: xlm("Flaubert"), 2, 4, False),
    "whisper": (whisper, 3, 4, False),
    "phi": (lambda: decoder("Phi"), 2, 4, True),  # output projection "dense"
    "xglm": (xglm, 2, 4, False),
    "mvp": (mvp, 3, 4, False),
    "internvl_vision": (internvl_vision, 2, 4, False),
    "data2vec_vision": (data2vec_vision, 2, 4, False),
    "yolos": (yolos, 2, 4, False),
    "mobilevit": (mobilevit, 9, 4, False),
    # q_norm and k_norm over each head's head_dim; head_dim 4 equals the head count, so
    # a norm's weight must not be taken for a per-head table
    "qwen3": (lambda: decoder("Qwen3", num_key_value_heads=2, head_dim=4), 2, 2, True),
    "gemma3": (lambda: decoder("Gemma3Text", model="Gemma3", **GQA), 2, 2, True),
    # q_norm and k_norm over all heads: the heads' rows masked before them, and the cut
    # norms rescaled (head_norms.py); without grouped queries q, k and v have one width,
    # with biases
    "olmo2": (lambda: decoder("Olmo2", **GQA), 2, 2, True),
    "olmo2_mha": (lambda: decoder("Olmo2", attention_bias=True), 2, 4, True),
    "olmo3": (lambda: decoder("Olmo3", **GQA), 2, 2, True),
    # an MLP of up_proj and down_proj (no gate) through XIELU, whose learned scalars and
    # epsilon make it nonzero at zero: the mask goes on down_proj's columns
    "apertus": (lambda: decoder("Apertus", **GQA), 2, 2, True),
    # a relative position bias table in every self-attention layer, cut per head; its
    # gated MLP's tanh GELU adds within each channel
    "umt5": (lambda: tiny_t5("UMT5"), 6, 4, True),
    # an output gate of the query width (gate_proj) cut with the heads; beside the second
    # layer's 4 experts, whose bias has as many entries as there are heads and stays
    "afmoe": (
        lambda: decoder(
            "Afmoe",
            head_dim=8,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            num_dense_layers=1,
        ),
        2,
        4,
        False,
    ),
}


def logits(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def export_checked(pruner: DTPPruner, model, inputs: tuple):
    """pruner.export(), checked here to compute what the hard-masked model computes."""
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = logits(model(*inputs))
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(exported(*inputs)), want, rtol=1e-5, atol=1e-5)
    return exported


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_export_with_exact_counts_equal_to_the_hard_masked_model(family, tmp_path):
    build, layers, units, config_follows = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = build()
    pruner = DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5})
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [g.size for g in heads] == [units] * layers
    with torch.no_grad():  # scores away from their initial order
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    masks = [m for g, m in zip(pruner.groups, pruner.hard_masks(), strict=True) if g in heads]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = export_checked(pruner, model, inputs)
    kept_config = [w for w in caught if "config cannot describe" in str(w.message)]
    assert len(kept_config) == (0 if config_follows else 1)
    modules = dict(exported.named_modules())
    names = {m: n for n, m in model.named_modules()}
    for group, mask in zip(heads, masks, strict=True):
        kept = int(mask.sum())
        assert kept == units // 2
        q, k, v, *positions = (modules[names[p.layer]] for p in group.rows)
        width = group.head_dim * kept
        assert q.out_features == width * group.query_heads_per_unit
        assert k.out_features == v.out_features == width
        assert all(p.out_features == width for p in positions)  # DeBERTa's
        assert modules[names[group.layer]].in_features == width * group.query_heads_per_unit
        attention = modules[names[group.module]]  # the head counts its code or users read
        for attr in ("num_heads", "n_heads", "num_attention_heads"):
            if isinstance(getattr(attention, attr, None), int):
                assert getattr(attention, attr) == kept * group.query_heads_per_unit, attr
        if hasattr(attention, "inner_dim"):  # UMT5's
            assert attention.inner_dim == width * group.query_heads_per_unit
        # a norm over all heads reads the rows the mask zeroes, and is cut with them
        assert len(group.rescaled) == (2 if family in NORMS_OVER_ALL_HEADS else 0)
        for rescaled in group.rescaled:
            assert torch.nn.utils.parametrize.is_parametrized(rescaled.rows, "weight")
            cut = modules[names[rescaled.norm]].weight.numel()
            assert cut == modules[names[rescaled.rows]].out_features == rescaled.per_unit * kept
        # the width its output is reshaped to is rewritten only where the cut needs it
        assert group.output_width == ("embed_dim" if family in WIDTH_REWRITTEN else "")
        if group.output_width:
            assert attention.embed_dim == width * group.query_heads_per_unit
            assert model.get_submodule(group.name).embed_dim == 32
    if any(g.output_width for g in heads) and exported.can_generate():  # cached path too
        with torch.no_grad(), pruner.hard_masked():
            want = model.generate(*inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        got = exported.generate(*inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert torch.equal(got, want)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    with torch.no_grad():  # the eager attention code computes the same
        sdpa = logits(exported(*inputs))
        exported.set_attn_implementation("eager")
        torch.testing.assert_close(logits(exported(*inputs)), sdpa, rtol=1e-5, atol=1e-5)
    if config_follows:  # save_pretrained / from_pretrained rebuild the pruned model
        exported.save_pretrained(tmp_path)
        loaded = type(exported).from_pretrained(tmp_path).eval()
        with torch.no_grad():
            torch.testing.assert_close(logits(loaded(*inputs)), logits(exported(*inputs)))


@pytest.mark.parametrize("family", ["Doge"])
def test_heads_the_layer_code_treats_otherwise_fail_their_proof_by_name(family):
    """Attention layers in a recognised form whose code treats the heads otherwise
    (Doge computes a mask per head from the values through a projection of their
    width): with half the heads removed the layer does not compute what it computes
    with them masked on its example input, so the heads are refused by name when the
    pruner is made, not at export; their MLPs prune."""
    model, inputs = decoder(family, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.self_attn': with some of"):
        DTPPruner(model, inputs, {"heads": 0.5})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    export_checked(DTPPruner(model, inputs, {"mlp": 0.5}), model, inputs)


def test_diffllama_heads_prune_in_pairs_across_the_two_halves(tmp_path):
    """DiffLlama subtracts the attention of query head h + H/2 from that of head h and
    normalizes each pair over both value halves: a unit is key/value heads j and
    j + K/2 with their query heads, in both halves of each projection. 8 query heads
    on 4 key/value heads: 2 units of 2 pairs; half kept. The export computes what the
    hard-masked model computes (sdpa and eager), its config says 4 heads on 2, and it
    round-trips and generates as the hard-masked model does."""
    config = transformers.DiffLlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        **TOKEN_IDS,
    )
    torch.manual_seed(0)
    model, inputs = transformers.DiffLlamaForCausalLM(config), (tokens(),)
    dense = [
        {k: v.clone() for k, v in layer.self_attn.state_dict().items()}
        for layer in model.model.layers
    ]
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    assert [(g.size, g.query_heads_per_unit) for g in pruner.groups] == [(2, 4)] * 2
    masks = pruner.hard_masks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = export_checked(pruner, model, inputs)
    assert not [w for w in caught if "config cannot describe" in str(w.message)]
    assert (exported.config.num_attention_heads, exported.config.num_key_value_heads) == (4, 2)
    for layer, weights, mask in zip(exported.model.layers, dense, masks, strict=True):
        (j,) = mask.nonzero().flatten().tolist()
        cut = layer.self_attn
        # query heads 2j, 2j+1 and 4+2j, 5+2j; key/value heads j and 2+j; pairs 2j, 2j+1
        queries = torch.cat([torch.arange(s, s + 16) for s in (j * 16, 32 + j * 16)])
        kv = torch.cat([torch.arange(s, s + 8) for s in (j * 8, 16 + j * 8)])
        torch.testing.assert_close(cut.q_proj.weight, weights["q_proj.weight"][queries])
        torch.testing.assert_close(cut.k_proj.weight, weights["k_proj.weight"][kv])
        torch.testing.assert_close(cut.v_proj.weight, weights["v_proj.weight"][kv])
        columns = weights["o_proj.weight"][:, j * 32 : j * 32 + 32]
        torch.testing.assert_close(cut.o_proj.weight, columns)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):  # all heads'
            torch.testing.assert_close(getattr(cut, name), weights[name])
    with torch.no_grad():
        sdpa = logits(exported(*inputs))
        exported.set_attn_implementation("eager")
        torch.testing.assert_close(logits(exported(*inputs)), sdpa, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), pruner.hard_masked():
        want = model.generate(*inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(
        exported.generate(*inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False), want
    )
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded(*inputs)), logits(exported(*inputs)))


def test_a_linear_layer_of_one_output_per_head_is_cut_with_the_heads(monkeypatch):
    """Laguna gates each head's output by a linear layer of one output per head
    (`g_proj`), a table cut with the heads. It is no group root of its own: Torch-Pruning's
    search from it does not end (bounded here to 5 s), and a float ratio prunes heads,
    experts and MLPs together, exported equal to the hard-masked model."""
    from dtp_kernels.pruning import channel_graph

    monkeypatch.setattr(channel_graph, "GROUP_SEARCH_SECONDS", 5.0)
    torch.manual_seed(0)
    model, inputs = decoder(
        "Laguna",
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    pruner = DTPPruner(model, inputs, 0.5)
    attention = model.model.layers[0].self_attn
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert (attention.g_proj, "weight", 0) in heads[0].tables
    assert {type(g).__name__ for g in pruner.groups} == {"HeadGroup", "ExpertGroup", "ChannelGroup"}
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    assert exported.model.layers[0].self_attn.g_proj.out_features == 2


@pytest.mark.parametrize("talking_head", [False, True], ids=["plain", "talking_heads"])
def test_deberta_in_proj_heads_export_with_their_biases_and_position_projections(talking_head):
    """DeBERTa's in_proj holds each head's query, key and value in turn; its query and
    value biases are vectors of the query width, its relative-position projections
    (pos_proj, pos_q_proj) hold a block of rows per head, and its talking heads mix the
    heads' logits and weights: all are cut with the heads, and the export computes what
    the hard-masked model computes, with the report's parameters."""
    torch.manual_seed(0)
    model, inputs = deberta(family="Deberta", talking_head=talking_head)
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5}))
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [(g.size, g.head_dim) for g in heads] == [(4, 8)] * 2
    exported = export_checked(pruner, model, inputs)
    for layer in exported.deberta.encoder.layer:
        attention = layer.attention.self
        assert (attention.num_attention_heads, attention.all_head_size) == (2, 16)
        assert attention.in_proj.out_features == 3 * 16
        assert attention.q_bias.shape == attention.v_bias.shape == (16,)
        assert attention.pos_proj.out_features == attention.pos_q_proj.out_features == 16
        if talking_head:
            assert attention.head_logits_proj.weight.shape == (2, 2)
        assert layer.attention.output.dense.in_features == 16
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_an_attention_layer_that_does_not_split_into_heads_leaves_the_mlps_prunable():
    """MiMo-V2-Flash's value heads are wider than its query heads, so its projections do
    not split into heads of `head_dim`: asking for its heads (a float asks for them too)
    is refused by name with the shapes, and a ratio for the MLPs alone still prunes and
    exports exactly."""
    model, inputs = decoder("MiMoV2Flash", num_key_value_heads=2, head_dim=8)
    for ratios in ({"heads": 0.5}, 0.5):
        with pytest.raises(ValueError, match=r"'model.layers.0.self_attn': q_proj \(32\), k_proj"):
            DTPPruner(model, inputs, ratios)
    pruner = DTPPruner(model, inputs, {"mlp": 0.5})
    assert [g.name for g in pruner.groups] == ["model.layers.0.mlp.gate_proj"]
    export_checked(pruner, model, inputs)


def bert_masked_lm():  # its LM head's dense layer feeds a LayerNorm over all channels
    config = transformers.BertConfig(**TINY_BERT, **TOKEN_IDS)
    return transformers.BertForMaskedLM(config), (tokens(),)


@pytest.mark.parametrize(
    "build, ratios",
    [
        (bert_masked_lm, 0.5),
        (bert_masked_lm, {"heads": 0.5, "mlp": 0.25}),
        (lambda: decoder("Doge", num_key_value_heads=2, head_dim=8), 0.5),
    ],
    ids=["bert-float", "bert-dict", "doge-float"],
)
def test_a_refusal_names_ratios_that_leave_the_refused_whole_and_prune_the_rest(build, ratios):
    """The error for groups that cannot be pruned (through a LayerNorm; heads failing
    their proof) ends with the ratios that leave just those whole: they prune the rest."""
    model, inputs = build()
    with pytest.raises(ValueError, match=r"ratio of 0 for them: ratios=") as refusal:
        DTPPruner(model, inputs, ratios)
    suggested = ast.literal_eval(str(refusal.value).rpartition("ratios=")[2])
    zeros = {name for name, ratio in suggested.items() if ratio == 0}
    assert zeros and all(name in str(refusal.value).rpartition(":")[0] for name in zeros)
    pruner = DTPPruner(model, inputs, suggested)
    assert {g.name for g in pruner.groups}.isdisjoint(zeros)
    assert {type(g).__name__ for g in pruner.groups} >= {"ChannelGroup"}
    randomised(pruner)
    pruned = [math.ceil(g.size * pruner.ratios[g.name]) for g in pruner.groups]
    assert [int(m.sum()) for m in pruner.hard_masks()] == [
        g.size - p for g, p in zip(pruner.groups, pruned, strict=True)
    ]
    export_checked(pruner, model, inputs)


def test_a_refusal_under_ratios_of_another_form_names_the_keys_to_set_to_0():
    """Per-stage lists and strings cannot take a name: the message names the keys."""
    assert zero_ratios([0, 0.5], ["a.b"]) == "the keys ['a.b'] with 0"
    assert zero_ratios("[0:0, 1-15:0.5]", ["a"]) == "the keys ['a'] with 0"
    assert zero_ratios(1, ["a"]) == "ratios={'*': 1, 'a': 0}"


def test_an_unknown_linear_layer_of_the_query_width_refuses_the_heads():
    """A linear layer of the attention layer computing the query width from its input,
    other than the projections and an output gate, is of a form the pruner does not know:
    asking for the heads is refused by name, before any mask."""
    model, inputs = decoder("Llama", layers=1)
    model.model.layers[0].self_attn.side = torch.nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"linear layer 'side' computes the query width \(32\)"):
        DTPPruner(model, inputs, {"heads": 0.5})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())


@pytest.mark.parametrize("norm", ["LayerNorm", "Gemma3RMSNorm"])
def test_a_norm_over_all_heads_that_rescaling_cannot_keep_refuses_heads_not_the_mlp(norm):
    """OLMo 2's queries normalized over all heads by a norm whose cut cannot be rescaled
    to compute what it did: a LayerNorm (it subtracts the mean, which the removed heads'
    zeros change) or Gemma's RMS norm (its weight is read as 1 + w). Heads are refused
    by name, before any mask; the MLPs still prune, exported equal to the hard-masked
    model."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    model, inputs = decoder("Olmo2", layers=1, num_key_value_heads=2)
    attention = model.model.layers[0].self_attn
    make = {"LayerNorm": torch.nn.LayerNorm, "Gemma3RMSNorm": Gemma3RMSNorm}[norm]
    attention.q_norm = make(attention.q_proj.out_features)
    with torch.no_grad():
        attention.q_norm.weight.uniform_(0.5, 1.5)
    with pytest.raises(
        ValueError,
        match=rf"layer 'model.layers.0.self_attn' feeds {norm} 'model.layers.0.self_attn.q_norm'\.",
    ):
        DTPPruner(model, inputs, {"heads": 0.5})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    pruner = DTPPruner(model, inputs, {"mlp": 0.5})
    assert [g.name for g in pruner.groups] == ["model.layers.0.mlp.gate_proj"]
    export_checked(pruner, model, inputs)


def gpt2(cross_attention=False):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=64, **TOKEN_IDS
    )
    config.add_cross_attention = cross_attention
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_conv1d_layers_are_refused_until_converted_to_equal_linear_layers():
    """GPT-2 stores its linear layers as transformers' Conv1D: refused by name, the model
    unchanged; conv1d_to_linear makes them nn.Linear computing the same outputs."""
    from dtp_kernels import conv1d_to_linear

    torch.manual_seed(0)
    model, ids = gpt2().eval(), tokens()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"GPT2LMHeadModel .* Conv1D \('transformer.h.0.attn.c_attn' and 7 "
    ):
        DTPPruner(model, (ids,), 0.5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        want = model(ids).logits
        assert conv1d_to_linear(model) is model
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    mlp = model.transformer.h[0].mlp
    assert type(mlp.c_fc) is torch.nn.Linear and mlp.c_fc.weight.shape == (64, 32)
    torch.testing.assert_close(mlp.c_fc.weight.t(), before["transformer.h.0.mlp.c_fc.weight"])
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, got str"):
        conv1d_to_linear("gpt2")


def test_gpt2_heads_and_mlp_export_equal_to_the_hard_masked_model_and_generate():
    """Converted to nn.Linear to prune, GPT-2 exports with its Conv1D layers back (cut),
    equal to the hard-masked model, and generates."""
    from dtp_kernels import conv1d_to_linear

    torch.manual_seed(0)
    model, ids = conv1d_to_linear(gpt2()), tokens()
    pruner = DTPPruner(model, (ids,), {"heads": 0.5, "mlp": 0.5})
    assert [(type(g).__name__, g.size) for g in pruner.groups] == [
        ("HeadGroup", 4),
        ("ChannelGroup", 64),
    ] * 2
    assert model.config.use_cache  # turned off only while Torch-Pruning traces the model
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, (ids,))
    for block in exported.transformer.h:
        attention = block.attn
        assert (attention.num_heads, attention.split_size) == (2, 16)
        assert attention.c_attn.nf == 48 and attention.c_proj.nx == 16  # Conv1D again
        assert block.mlp.c_fc.nf == block.mlp.c_proj.nx == 32
    assert not any(type(m) is torch.nn.Linear for m in exported.transformer.modules())
    assert type(model.transformer.h[0].attn.c_attn) is torch.nn.Linear  # the model stays
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    generated = exported.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4)


def test_openai_gpt_heads_export_with_its_head_count_and_split_size():
    """OpenAI GPT's attention is GPT-2's c_attn and c_proj, its head count kept as n_head
    and no head_dim (split_size over n_head): its heads are groups, and export writes
    n_head and split_size, computing what the hard-masked model computes."""
    from dtp_kernels import conv1d_to_linear

    torch.manual_seed(0)
    config = transformers.OpenAIGPTConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16
    )
    model, ids = conv1d_to_linear(transformers.OpenAIGPTLMHeadModel(config)), tokens()
    pruner = DTPPruner(model, (ids,), {"heads": 0.5})
    assert [(type(g).__name__, g.size, g.head_dim) for g in pruner.groups] == [
        ("HeadGroup", 4, 8)
    ] * 2
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, (ids,))
    for block in exported.transformer.h:
        assert (block.attn.n_head, block.attn.split_size, block.attn.c_attn.nf) == (2, 16, 48)


def test_a_mixed_attention_layer_is_refused_with_ratios_that_leave_it_whole():
    """ConvBERT's output projection reads its heads and its span convolutions alike, so
    its query/key/value do not split the projection into heads: a float is refused naming
    the layers, with ratios that leave them whole; those prune its MLPs and export."""
    config = transformers.ConvBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        embedding_size=32,
        pad_token_id=0,
    )
    model, ids = transformers.ConvBertForSequenceClassification(config).eval(), tokens()
    with pytest.raises(ValueError, match=r"'convbert.encoder.layer.0.attention': query/key") as e:
        DTPPruner(model, (ids,), 0.5)
    suggested = ast.literal_eval(str(e.value).rpartition("ratios=")[2])
    assert suggested == {
        "*": 0.5,
        "convbert.encoder.layer.0.attention": 0,
        "convbert.encoder.layer.1.attention": 0,
    }
    pruner = DTPPruner(model, (ids,), suggested)
    assert {type(g).__name__ for g in pruner.groups} == {"ChannelGroup"}
    export_checked(pruner, model, (ids,))


def test_linear_layers_go_back_to_the_conv1d_layers_gpt2_builds():
    """linear_to_conv1d undoes conv1d_to_linear: the same outputs, Conv1D where GPT-2
    builds one (a Linear shared by two places: one Conv1D), other Linear layers left."""
    from dtp_kernels import conv1d_to_linear
    from dtp_kernels.pruning.conv1d import linear_to_conv1d

    torch.manual_seed(0)
    model, ids = conv1d_to_linear(gpt2()).eval(), tokens()
    blocks = model.transformer.h
    blocks[1].mlp.c_fc = blocks[0].mlp.c_fc
    with torch.no_grad():
        want = model(ids).logits
        assert linear_to_conv1d(model) is model
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert type(blocks[0].attn.c_attn).__name__ == "Conv1D"
    assert blocks[1].mlp.c_fc is blocks[0].mlp.c_fc
    assert type(model.lm_head) is torch.nn.Linear  # GPT-2 builds it as a Linear


def test_gpt2_weights_pruned_one_by_one_export_in_its_own_layout():
    """Under granularity='weight' the export is a copy with the pruned weights zero,
    with GPT-2's Conv1D layers back too (the zeros transposed with them). Its output
    layer's weight is the embedding's: a mask would reach one of its two uses, so it is
    left whole, with a warning naming it."""
    from dtp_kernels import conv1d_to_linear

    torch.manual_seed(0)
    model, ids = conv1d_to_linear(gpt2()), tokens()
    with pytest.warns(UserWarning, match=r"\['lm_head'\] are tied to .*'transformer.wte'"):
        pruner = DTPPruner(model, (ids,), 0.5, granularity="weight")
    assert "lm_head" not in [g.name for g in pruner.groups]
    exported = pruner.export()  # checked equal to the hard-masked model
    layer, linear = exported.transformer.h[0].mlp.c_fc, model.transformer.h[0].mlp.c_fc
    assert type(layer).__name__ == "Conv1D"
    mask = pruner.hard_masks()[[g.name for g in pruner.groups].index("transformer.h.0.mlp.c_fc")]
    assert torch.equal(layer.weight != 0, mask.view_as(linear.weight).t().bool())


class _CrossAttending(torch.nn.Module):
    """GPT-2 attending to an encoder's states (its cross-attention: q_attn for the
    queries, c_attn for the keys and values)."""

    def __init__(self):
        super().__init__()
        self.gpt2 = gpt2(cross_attention=True)

    def forward(self, ids, states):
        return self.gpt2(input_ids=ids, encoder_hidden_states=states).logits


def test_gpt2_cross_attention_heads_export_equal_to_the_hard_masked_model():
    from dtp_kernels import conv1d_to_linear

    torch.manual_seed(0)
    model = conv1d_to_linear(_CrossAttending())
    inputs = (tokens(), torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3)))
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    assert [g.name for g in pruner.groups] == [
        f"gpt2.transformer.h.{i}.{kind}" for i in (0, 1) for kind in ("attn", "crossattention")
    ]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    cross = exported.gpt2.transformer.h[0].crossattention
    assert (cross.q_attn.nf, cross.c_attn.nf, cross.split_size) == (16, 32, 16)


def falcon(**form):  # multi-query attention unless `form` says otherwise
    config = transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        **form,
        **TOKEN_IDS,
    )
    return transformers.FalconForCausalLM(config), (tokens(),)


def gpt_neox():
    config = transformers.GPTNeoXConfig(num_hidden_layers=2, **DECODER)
    return transformers.GPTNeoXForCausalLM(config), (tokens(),)


def bloom():
    config = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **TOKEN_IDS
    )
    return transformers.BloomForCausalLM(config), (tokens(),)


def mpt():
    config = transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4)
    return transformers.MptForCausalLM(config), (tokens(),)


def gpt_bigcode(multi_query=True):
    config = transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, multi_query=multi_query, **TOKEN_IDS
    )
    return transformers.GPTBigCodeForCausalLM(config), (tokens(),)


def hf_swin():  # a relative position bias table with one column per head
    config = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2
    )
    return transformers.SwinForImageClassification(config), (torch.randn(2, 3, 32, 32),)


def swinv2():  # a per-head logit scale, and a bias MLP whose last layer has a row per head
    config = transformers.Swinv2Config(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2
    )
    return transformers.Swinv2ForImageClassification(config), (torch.randn(2, 3, 32, 32),)


def beit(shared=False):  # a bias table per layer, in the block beside the attention
    config = transformers.BeitConfig(
        use_relative_position_bias=not shared,
        use_shared_relative_position_bias=shared,
        **TINY_HF_VIT,
    )
    return transformers.BeitForImageClassification(config), (torch.randn(2, 3, 16, 16),)


# family: (builder, key/value heads per layer, query heads per key/value head); the
# fused projection holds each unit's query heads, key and value in turn
PER_HEAD_FUSED = {
    "gpt_neox": (gpt_neox, 4, 1),
    "gpt_neox_japanese": (gpt_neox_japanese, 4, 1),
    "falcon_grouped": (lambda: falcon(new_decoder_architecture=True, num_kv_heads=2), 2, 2),
    "falcon_rotary": (lambda: falcon(multi_query=False), 4, 1),
    "gpt_bigcode": (lambda: gpt_bigcode(multi_query=False), 4, 1),
}


@pytest.mark.parametrize("family", PER_HEAD_FUSED)
def test_per_head_fused_qkv_heads_export_equal_to_the_hard_masked_model_and_generate(family):
    """GPT-NeoX's, Falcon's (grouped, or one key/value head per query head) and
    GPT-BigCode's fused projection keeps whole units of rows: the export keeps exactly the
    units asked for, computes what the hard-masked model computes and generates. GPT-NeoX
    Japanese's `dense_bias`, of the query width but added after the output projection,
    stays whole."""
    build, units, per_unit = PER_HEAD_FUSED[family]
    torch.manual_seed(0)
    model, inputs = build()
    pruner = DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5})
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [(g.size, g.query_heads_per_unit) for g in heads] == [(units, per_unit)] * 2
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    with pytest.warns(UserWarning, match="config cannot describe"):  # hidden_size / heads
        exported = export_checked(pruner, model, inputs)
    modules, names = dict(exported.named_modules()), {m: n for n, m in model.named_modules()}
    kept = units // 2
    for group in heads:
        (fused,) = (modules[names[p.layer]] for p in group.rows)
        assert fused.out_features == kept * (per_unit + 2) * group.head_dim
        assert modules[names[group.layer]].in_features == kept * per_unit * group.head_dim
        attention = modules[names[group.module]]
        counts = {
            "num_heads": kept * per_unit,
            "num_kv_heads": kept,  # Falcon's
            "kv_heads": kept,  # GPT-BigCode's
            "kv_dim": kept * group.head_dim,
        }
        for attr, value in counts.items():
            if hasattr(attention, attr):
                assert getattr(attention, attr) == value, attr
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    if family == "gpt_neox_japanese":
        assert exported.gpt_neox_japanese.layers[1].attention.dense_bias.shape == (32,)
    generated = exported.generate(inputs[0][:1], max_new_tokens=3, min_new_tokens=3)
    assert generated.shape == (1, inputs[0].shape[1] + 3)


KV_LAYERS = (".k_proj", ".v_proj")  # separate key and value projections, left whole
SEPARATE_KV = ("llama", "gemma")
# family: (builder, whether the config can describe the pruned model)
MULTI_QUERY = {
    "llama": (lambda: decoder("Llama", num_key_value_heads=1), True),
    "gemma": (lambda: decoder("Gemma", num_key_value_heads=1, head_dim=8), True),  # Gemma 2B's
    "phi3": (lambda: decoder("Phi3", num_key_value_heads=1), True),  # fused qkv_proj
    "falcon": (falcon, False),  # Falcon-7B's fused query_key_value
    "falcon_grouped": (lambda: falcon(new_decoder_architecture=True, num_kv_heads=1), False),
    # its code splits c_attn at embed_dim, the query width as built: export writes it
    "gpt_bigcode": (gpt_bigcode, False),
}


@pytest.mark.parametrize("family", MULTI_QUERY)
def test_multi_query_attention_loses_query_heads_and_keeps_its_key_and_value(family, tmp_path):
    """With one key/value head for all query heads (Gemma 2B's, Falcon-7B's, StarCoder's
    GPT-BigCode), a unit is
    a query head: the export keeps exactly the query heads asked for with the key and
    value rows whole, equals the hard-masked model, generates and, where the config
    can describe it, round-trips through save_pretrained."""
    build, config_follows = MULTI_QUERY[family]
    torch.manual_seed(0)
    model, inputs = build()
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    assert [(g.size, g.query_heads_per_unit, g.shared_kv) for g in pruner.groups] == [
        (4, 1, True)
    ] * 2
    before = {n: m.weight.shape for n, m in model.named_modules() if n.endswith(KV_LAYERS)}
    assert bool(before) == (family in SEPARATE_KV)
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = export_checked(pruner, model, inputs)
    assert any("config cannot describe" in str(w.message) for w in caught) != config_follows
    modules, names = dict(exported.named_modules()), {m: n for n, m in model.named_modules()}
    for group in pruner.groups:
        (queries,) = (modules[names[p.layer]] for p in group.rows)
        shared_rows = 0 if family in SEPARATE_KV else 2  # a fused key and value head
        assert queries.out_features == (2 + shared_rows) * group.head_dim
        assert modules[names[group.layer]].in_features == 2 * group.head_dim
        attention = modules[names[group.module]]
        for attr in ("num_key_value_heads", "num_kv_heads", "kv_heads"):
            assert getattr(attention, attr, 1) == 1, attr
        if family == "gpt_bigcode":
            assert attention.embed_dim == 2 * group.head_dim
    assert all(modules[n].weight.shape == shape for n, shape in before.items())
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    generated = exported.generate(inputs[0][:1], max_new_tokens=3, min_new_tokens=3)
    assert generated.shape == (1, inputs[0].shape[1] + 3)
    with torch.no_grad():  # eager attention repeats the key and value for each query head
        sdpa = exported(*inputs).logits
        exported.set_attn_implementation("eager")
        torch.testing.assert_close(exported(*inputs).logits, sdpa, rtol=1e-5, atol=1e-5)
    if config_follows:
        assert exported.config.num_key_value_heads == 1
        exported.save_pretrained(tmp_path)
        loaded = type(exported).from_pretrained(tmp_path).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(*inputs).logits, exported(*inputs).logits)


def own_attention(model: torch.nn.Module, attention: str) -> torch.nn.Module:
    """`model` with each layer named `attention` of its blocks made the user's own
    subclass of its class, for which export has no class that picks its heads' entries
    of the bias the model hands it."""
    for i in (0, 1):
        layer = model.get_submodule(attention.format(i))
        layer.__class__ = type(f"Own{type(layer).__name__}", (type(layer),), {})
    return model


# family: (builder, why its heads are refused, its attention layers, the MLP layers
# that are its groups)
REFUSED_HEADS = {
    "bloom": (
        lambda: (own_attention(bloom()[0], "transformer.h.{}.self_attention"), (tokens(),)),
        "handed `alibi`",
        "transformer.h.{}.self_attention",
        "transformer.h.{}.mlp.dense_h_to_4h",
    ),
    "mpt": (
        lambda: (own_attention(mpt()[0], "transformer.blocks.{}.attn"), (tokens(),)),
        "takes `position_bias`",
        "transformer.blocks.{}.attn",
        "transformer.blocks.{}.ffn.up_proj",
    ),
}


@pytest.mark.parametrize("family", REFUSED_HEADS)
def test_heads_that_cannot_export_exactly_are_refused_by_name_and_the_mlp_prunes(family):
    """An attention layer of a class export does not know, handed ALiBi computed for
    all heads outside it (BLOOM's and MPT's, their layers the user's own subclass; the
    library's own are pruned: test_alibi_attention.py), would not lose its heads.
    Asking for their heads names every layer and why, the model untouched; their MLPs
    prune and export exactly."""
    build, why, attention, mlp = REFUSED_HEADS[family]
    torch.manual_seed(0)
    model, inputs = build()
    with pytest.raises(ValueError, match=r"cannot prune the heads of") as refused:
        DTPPruner(model, inputs, {"heads": 0.5})
    message = str(refused.value)
    for i in (0, 1):
        assert f"layer {attention.format(i)!r}: " in message
    assert message.count(why) == message.count("; the heads of attention layer ") + 1
    with pytest.raises(ValueError, match=r"cannot prune the heads of"):  # a float asks for all
        DTPPruner(model, inputs, 0.5)
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    pruner = DTPPruner(model, inputs, {"mlp": 0.5})
    assert [g.name for g in pruner.groups][:2] == [mlp.format(i) for i in (0, 1)]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    export_checked(pruner, model, inputs)


PER_HEAD_TABLES = {"swin": hf_swin, "swinv2": swinv2, "beit": beit}


@pytest.mark.parametrize("family", PER_HEAD_TABLES)
def test_per_head_tables_are_cut_to_the_kept_heads(family):
    """A learned table with an entry per head (Swin's and BEiT's relative position bias,
    Swin V2's logit scale and bias MLP rows) loses the removed heads' entries with them:
    the export equals the hard-masked model and the predicted parameter count holds."""
    torch.manual_seed(0)
    model, inputs = PER_HEAD_TABLES[family]()
    pruner = DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5})
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert heads and all(g.tables for g in heads)
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    modules, names = dict(exported.named_modules()), {m: n for n, m in model.named_modules()}
    for group in heads:
        for owner, name, dim in group.tables:
            before = getattr(owner, name).shape
            after = getattr(modules[names[owner]], name).shape
            assert after[dim] == before[dim] // 2 and after[:dim] == before[:dim]
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def segformer(heads: list[int], sr_ratios: list[int], head: str = "ForSemanticSegmentation"):
    """A SegFormer of two stages of one block, `heads` heads each."""
    config = transformers.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=sr_ratios,
        hidden_sizes=[16, 32],
        num_attention_heads=heads,
        decoder_hidden_size=32,
        num_labels=3,
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
    )
    torch.manual_seed(0)
    return getattr(transformers, f"Segformer{head}")(config).eval()


def test_a_conv_in_the_attention_as_wide_as_its_heads_is_no_table():
    """SegFormer's attention reduces its keys' and values' sequence with a conv whose
    kernel (2 x 2) is as wide as the layer has heads (2): its weight is no table of
    heads (nor heads mixed with heads), and the heads prune, export equal."""
    model = segformer([2, 4], sr_ratios=[2, 1])
    inputs = (torch.randn(1, 3, 32, 32),)
    pruner = DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5})
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [g.units for g in heads] == [2, 4] and not any(g.tables for g in heads)
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    export_checked(pruner, model, inputs)


def test_a_config_holding_one_head_count_per_stage_is_left_with_a_warning():
    """SegFormer's config holds a head count per stage: with every stage keeping one
    count (2 of 4 heads each), export must not write that one number in its place (its
    strict config would refuse it, after training): the config is left unchanged, with
    a warning, and the model is right."""
    model = segformer([4, 4], sr_ratios=[1, 1], head="ForImageClassification")
    inputs = (torch.randn(1, 3, 32, 32),)
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    with pytest.warns(UserWarning, match="config cannot describe its sizes"):
        exported = export_checked(pruner, model, inputs)
    assert exported.config.num_attention_heads == [4, 4]


def test_a_fused_layer_counting_its_heads_in_num_attention_heads():
    """SAM's vision encoder: a fused qkv and proj whose layer keeps only
    `num_attention_heads` (windowed and global attention, decomposed relative positions
    of the head size shared by all heads): its heads prune, export equal, with the count
    written."""
    config = transformers.SamVisionConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_dim=64,
        image_size=32,
        patch_size=4,
        output_channels=16,
        window_size=2,
        global_attn_indexes=[1],
    )
    torch.manual_seed(0)
    model = transformers.SamVisionModel(config).eval()
    inputs = (torch.randn(1, 3, 32, 32),)
    pruner = DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5})
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [(g.units, g.head_dim) for g in heads] == [(4, 8), (4, 8)]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    assert [layer.attn.num_attention_heads for layer in exported.vision_encoder.layers] == [2, 2]
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


class TalkingHeads(torch.nn.Module):
    """Attention whose heads' scores are mixed across heads by a learned matrix (plain
    attention with mixed=False)."""

    def __init__(self, heads=4, head_dim=8, mixed=True):
        super().__init__()
        width = heads * head_dim
        self.head_dim = head_dim
        self.q_proj, self.k_proj = torch.nn.Linear(32, width), torch.nn.Linear(32, width)
        self.v_proj, self.o_proj = torch.nn.Linear(32, width), torch.nn.Linear(width, 32)
        self.mix = torch.nn.Parameter(torch.eye(heads) + 0.1) if mixed else None

    def forward(self, x):
        def split(t):
            return t.view(*t.shape[:2], -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = q @ k.transpose(-1, -2)
        if self.mix is not None:
            scores = torch.einsum("hg,bgqk->bhqk", self.mix, scores)
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).flatten(2))


def test_a_parameter_mixing_heads_with_heads_is_refused_by_name():
    model = TalkingHeads()
    with pytest.raises(ValueError, match=r"heads of attention layer '': its mix \(4, 4\)"):
        DTPPruner(model, (torch.randn(2, 5, 32),), {"heads": 0.5})


def test_a_table_all_layers_share_refuses_the_heads_by_name():
    """BEiT's shared relative position bias lives outside every attention layer and their
    blocks: export could not cut it for each layer's heads. The proof on each layer's
    example input shows removing heads differs from masking them, so the heads are
    refused by name when the pruner is made, before any mask."""
    model, inputs = beit(shared=True)
    with pytest.raises(ValueError, match=r"layer 'beit.layers.0.attention': with some"):
        DTPPruner(model, inputs, {"heads": 0.5})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())


@pytest.mark.parametrize("family, field", [("opt", "ffn_dim"), ("gpt2", "n_inner")])
def test_mlp_width_under_each_family_config_field_round_trips(family, field, tmp_path):
    """OPT names its MLP width ffn_dim, GPT-2 n_inner (pruned as nn.Linear layers,
    exported with its Conv1D layers back): pruning the MLPs alone writes it, and
    from_pretrained rebuilds the exported model, without a warning."""
    from dtp_kernels import conv1d_to_linear

    torch.manual_seed(0)
    model, inputs = opt() if family == "opt" else (conv1d_to_linear(gpt2()), (tokens(),))
    pruner = DTPPruner(model, inputs, {"mlp": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exported = export_checked(pruner, model, inputs)
    assert getattr(exported.config, field) == 32
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, exported(*inputs).logits)


def test_a_group_cutting_a_tied_weight_is_refused_with_the_ratios_that_leave_it_whole():
    """OPT-350m's embedding width differs from its model width: `project_out` widens the
    last hidden states for the output layer, whose weight is the embedding's. Cutting
    the output layer's columns would untie it (a model larger than before, which
    save_pretrained would tie again): a float ratio is refused naming the group, before
    anything changes, and the ratios the error gives prune the rest with the tie kept."""
    torch.manual_seed(0)
    model, inputs = opt(word_embed_proj_dim=16)
    with pytest.raises(ValueError, match=r"'model.decoder.project_out' cuts 'lm_head'") as error:
        DTPPruner(model, inputs, 0.5)
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    ratios = ast.literal_eval(str(error.value).split("for them: ratios=")[-1])
    assert ratios == {"*": 0.5, "model.decoder.project_out": 0}
    pruner = DTPPruner(model, inputs, ratios)
    with pytest.warns(UserWarning, match="config cannot describe"):  # heads of OPT's size
        exported = export_checked(pruner, model, inputs)
    assert exported.lm_head.weight is exported.model.decoder.embed_tokens.weight
    assert count_params(exported) == pruner.report()["params_after"] < count_params(model)


def test_a_config_that_cannot_rebuild_the_export_warns_even_with_nothing_to_write():
    """BLOOM's MLP width is 4 x hidden_size, no field of its config: save_pretrained
    would write what from_pretrained cannot load, so export says so. (BART's two MLP
    widths are written: tests/pruning/test_mlp_config_fields.py.)"""
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    model, inputs = transformers.BloomForCausalLM(config), (tokens(),)
    pruner = DTPPruner(model, inputs, {"mlp": 0.5})
    with pytest.warns(UserWarning, match=r"config cannot describe its sizes"):
        pruner.export()


def test_raw_expert_weights_beside_the_attention_are_not_taken_for_head_tables():
    """Mixtral's mixture of experts keeps raw per-expert weights (experts first) in the
    block beside the attention; with as many experts as heads they still are not
    per-head tables: the heads export exactly and the experts stay whole."""
    torch.manual_seed(0)
    model, inputs = decoder("Mixtral", num_key_value_heads=4, num_local_experts=4)
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    assert all(not g.tables for g in pruner.groups)
    exported = export_checked(pruner, model, inputs)
    dense, pruned = model.state_dict(), exported.state_dict()
    assert all(pruned[k].shape == v.shape for k, v in dense.items() if "experts" in k)


def test_attention_sinks_are_cut_with_their_heads_and_the_experts_stay_whole():
    """GPT-OSS learns one attention sink per query head (`sinks`): a per-head table, cut
    with the heads; its experts (raw 3-D parameters) are left whole."""
    torch.manual_seed(0)
    model, inputs = decoder(
        "GptOss", num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2
    )
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    assert [[name for _, name, _ in g.tables] for g in pruner.groups] == [["sinks"]] * 2
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    for layer in exported.model.layers:
        assert layer.self_attn.sinks.shape == (2,)  # one key/value head of two query heads
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


# the sizes ModernBERT's encoder and decoder share
MODERNBERT = dict(DECODER, num_hidden_layers=2, cls_token_id=1, sep_token_id=2)


def test_modernbert_fused_qkv_heads_and_glu_mlp_export_exactly():
    """ModernBERT's Wqkv (query, key and value blocks; no head-count attribute) and Wo
    are heads; its Wi, chunked into input and gate, is a group of pairs."""
    config = transformers.ModernBertConfig(**MODERNBERT)
    torch.manual_seed(0)
    model, inputs = transformers.ModernBertModel(config), (tokens(),)
    pruner = DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5})
    assert [(g.name, g.size) for g in pruner.groups] == [
        (f"layers.{i}.{part}", size) for i in (0, 1) for part, size in (("attn", 4), ("mlp.Wi", 64))
    ]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    for layer in exported.layers:
        assert (layer.attn.Wqkv.out_features, layer.attn.Wo.in_features) == (48, 16)
        assert (layer.mlp.Wi.out_features, layer.mlp.Wo.in_features) == (64, 32)


def test_modernbert_decoder_separate_projections_with_wo_export_exactly():
    """ModernBERT's decoder writes q_proj, k_proj and v_proj with the output projection
    Wo; its LM head's dense layer feeds a LayerNorm over all channels (refused by name
    when asked for, so it is left whole here)."""
    config = transformers.ModernBertDecoderConfig(**MODERNBERT)
    torch.manual_seed(0)
    model, inputs = transformers.ModernBertDecoderForCausalLM(config), (tokens(),)
    with pytest.raises(ValueError, match=r"layer 'lm_head.dense' feeds LayerNorm 'lm_head.norm'"):
        DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5})
    pruner = DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5, "lm_head.dense": 0})
    assert [(g.name, type(g).__name__, g.size) for g in pruner.groups][::2] == [
        (f"model.layers.{i}.attn", "HeadGroup", 4) for i in (0, 1)
    ]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    for layer in exported.model.layers:
        attention = layer.attn
        assert [attention.q_proj.out_features, attention.Wo.in_features] == [16, 16]
        assert attention.k_proj.out_features == attention.v_proj.out_features == 16
        assert attention.num_heads == 2 and attention.all_head_size == 16


@pytest.mark.parametrize(
    "version, q_lora_rank", [(3, 20), (3, None), (2, 20)], ids=["v3", "v3-q_proj", "v2"]
)
def test_latent_attention_heads_export_exactly_without_the_channel_graph(
    version, q_lora_rank, tmp_path
):
    """DeepSeek's multi-head latent attention (q_b_proj or q_proj, kv_b_proj, o_proj per
    head; the latents shared): heads prune although Torch-Pruning's graph cannot follow
    the model (it fails on V3, its search on V2's kv_a_proj_with_mqa); the export keeps
    exactly the rows and columns of the kept heads, equals the hard-masked model under
    SDPA and eager attention, generates, and its config (heads; head_dim, the rotary
    one, untouched) round-trips through save_pretrained."""
    model, inputs = tiny_deepseek(version, q_lora_rank), (tokens(),)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if hasattr(m, "weight")}
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    assert [(g.name, g.size, g.latent) for g in pruner.groups] == [
        (f"model.layers.{i}.self_attn", 4, True) for i in (0, 1)
    ]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    masks = pruner.hard_masks()
    exported = export_checked(pruner, model, inputs)
    query = "q_b_proj" if q_lora_rank else "q_proj"
    for i, (layer, mask) in enumerate(zip(exported.model.layers, masks, strict=True)):
        kept, attn, prefix = (
            mask.nonzero().flatten(),
            layer.self_attn,
            f"model.layers.{i}.self_attn",
        )
        for part, per_head, dim in ((query, 12, 0), ("kv_b_proj", 14, 0), ("o_proj", 6, 1)):
            index = (kept[:, None] * per_head + torch.arange(per_head)).flatten()
            want = dense[f"{prefix}.{part}"].index_select(dim, index)
            torch.testing.assert_close(getattr(attn, part).weight, want, rtol=0, atol=0)
        assert attn.num_heads == 2
        assert attn.kv_a_proj_with_mqa.weight.shape == dense[f"{prefix}.kv_a_proj_with_mqa"].shape
    config = exported.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 2, 4)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    with torch.no_grad():
        sdpa = exported(*inputs).logits
        exported.set_attn_implementation("eager")
        torch.testing.assert_close(exported(*inputs).logits, sdpa, rtol=1e-5, atol=1e-5)
    assert exported.generate(inputs[0][:1], max_new_tokens=3, do_sample=False).shape == (1, 12)
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, exported(*inputs).logits)


# a latent attention (4 heads; query 8 + 4 rotary, value 6) beside a sparse-attention
# indexer of 2 heads of its own, in 2 dense layers (HunYuan V4's, A.X K2's configs)
SPARSE_LATENT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_hidden_layers=2,
    intermediate_size=64,
    q_lora_rank=20,
    kv_lora_rank=12,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=4,
    mlp_layer_types=["dense", "dense"],
)


def test_latent_attention_output_gate_and_sinks_are_cut_with_the_heads():
    """HunYuan V4's latent attention gates its output head by head with gate_proj (of the
    layer's input, not the compressed query q_b_proj reads) and adds a learned sink per
    head beside a sparse-attention indexer of its own heads: the gate's rows and the
    sinks of the kept heads stay, the indexer stays whole, and the export computes what
    the hard-masked model computes."""
    config = transformers.HYV4Config(**SPARSE_LATENT, **TOKEN_IDS)
    torch.manual_seed(0)
    model, inputs = transformers.HYV4ForCausalLM(config).eval(), (tokens(),)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.sinks.normal_()
    gate, sinks = attn.gate_proj.weight.detach().clone(), attn.sinks.detach().clone()
    indexer = {n: p.detach().clone() for n, p in attn.indexer.named_parameters()}
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    assert [(g.name, g.latent) for g in pruner.groups] == [
        (f"model.layers.{i}.self_attn", True) for i in (0, 1)
    ]
    kept = pruner.hard_masks()[0].nonzero().flatten()
    exported = export_checked(pruner, model, inputs)
    cut = exported.model.layers[0].self_attn
    rows = (kept[:, None] * 6 + torch.arange(6)).flatten()
    torch.testing.assert_close(cut.gate_proj.weight, gate[rows], rtol=0, atol=0)
    torch.testing.assert_close(cut.sinks, sinks[kept], rtol=0, atol=0)
    for name, parameter in cut.indexer.named_parameters():
        torch.testing.assert_close(parameter, indexer[name], rtol=0, atol=0)


def test_latent_attention_fused_query_and_gate_are_cut_head_by_head(tmp_path):
    """A.X K2's latent attention has no q_b_proj: q_gate_proj holds each head's query
    rows (nope + rope), then the v_head_dim rows of its sigmoid output gate. Its heads
    prune: export keeps whole blocks of the kept heads' rows there (query and gate),
    in kv_b_proj and o_proj's columns, leaves the compressed query (which the
    sparse-attention indexer also reads) and the indexer whole, computes what the
    hard-masked model computes and round-trips through save_pretrained."""
    config = transformers.AXK2Config(
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        head_dim=4,
        gated_norm_rank=4,
        **SPARSE_LATENT,
        **TOKEN_IDS,
    )
    torch.manual_seed(0)
    model, inputs = transformers.AXK2ForCausalLM(config).eval(), (tokens(),)
    attn = model.model.layers[0].self_attn
    fused, kv_up = attn.q_gate_proj.weight.detach().clone(), attn.kv_b_proj.weight.detach().clone()
    whole = {
        n: p.detach().clone() for n, p in attn.named_parameters() if "q_a_" in n or "indexer" in n
    }
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    assert [(g.name, g.size, g.latent) for g in pruner.groups] == [
        (f"model.layers.{i}.self_attn", 4, True) for i in (0, 1)
    ]
    kept = pruner.hard_masks()[0].nonzero().flatten()
    exported = export_checked(pruner, model, inputs)
    cut = exported.model.layers[0].self_attn
    for weight, dense, per_head in (
        (cut.q_gate_proj.weight, fused, 18),
        (cut.kv_b_proj.weight, kv_up, 14),
    ):
        rows = (kept[:, None] * per_head + torch.arange(per_head)).flatten()
        torch.testing.assert_close(weight, dense[rows], rtol=0, atol=0)
    for name, parameter in cut.named_parameters():
        if name in whole:
            torch.testing.assert_close(parameter, whole[name], rtol=0, atol=0)
    assert exported.config.num_attention_heads == 2
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, exported(*inputs).logits)


def test_fused_projection_with_fewer_key_value_heads_prunes_by_key_value_head():
    """DBRX's Wqkv holds all query heads, then 2 key heads, then 2 value heads, and its
    code splits it at its `hidden_size`: a unit is a key/value head with its 2 query
    heads; export keeps their rows, writes the layer's query width and head counts, and
    computes what the hard-masked model computes."""
    model, inputs = tiny_dbrx(), (tokens(),)
    fused = model.transformer.blocks[0].norm_attn_norm.attn.Wqkv.weight.detach().clone()
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    assert [(g.name, g.units, g.query_heads_per_unit) for g in pruner.groups] == [
        (f"transformer.blocks.{i}.norm_attn_norm.attn", 2, 2) for i in (0, 1)
    ]
    (unit,) = pruner.hard_masks()[0].nonzero().flatten().tolist()
    # its key/value head count is in a part's config (attn_config), which export leaves
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = export_checked(pruner, model, inputs)
    attn = exported.transformer.blocks[0].norm_attn_norm.attn
    head = torch.arange(8)
    rows = torch.cat([unit * 16 + torch.arange(16), 32 + unit * 8 + head, 48 + unit * 8 + head])
    torch.testing.assert_close(attn.Wqkv.weight, fused[rows], rtol=0, atol=0)
    assert (attn.hidden_size, attn.num_heads, attn.num_key_value_heads) == (16, 2, 1)


def test_grouped_output_projection_keeps_as_many_heads_in_each_group():
    """DeepSeek-V4's o_a_proj is block-diagonal: group g's 4 heads feed its 12 rows only.
    A head's mask zeroes its columns in its own group's rows (not the same columns of the
    other group), every group keeps as many heads, export keeps each group's own heads'
    columns, q_b_proj's rows and sinks, the key/value head whole, and computes what the
    hard-masked model computes with the parameters the report predicts; the config
    rebuilds it."""
    model, inputs = tiny_deepseek_v4(), (tokens(),)
    attn = model.model.layers[0].self_attn
    dense = {n: p.detach().clone() for n, p in attn.named_parameters()}
    # a head's filter (magnitude scores, the L1 baseline): its columns in its group's rows
    filters = match_form("attn", attn).unit_weights()
    blocks = dense["o_a_proj.weight"].view(2, 12, 4, 16)
    for head in range(8):
        torch.testing.assert_close(filters[head], blocks[head // 4, :, head % 4].flatten())
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    assert [(g.name, g.size, g.segments) for g in pruner.groups if isinstance(g, HeadGroup)] == [
        (f"model.layers.{i}.self_attn", 8, 2) for i in (0, 1)
    ]
    mask = pruner.hard_masks()[0]
    assert mask.view(2, 4).sum(1).tolist() == [2, 2]
    with torch.no_grad(), pruner.hard_masked():  # the mask, seen on the weight
        blocks = attn.o_a_proj.weight.view(2, 12, 4, 16)
        for head, on in enumerate(mask.tolist()):
            in_run = blocks[head // 4, :, head % 4]
            assert bool(in_run.abs().sum() > 0) == bool(on)
    kept = mask.nonzero().flatten()
    exported, _ = described_export(pruner, model, inputs)
    cut = exported.model.layers[0].self_attn
    want = torch.stack(
        [
            dense["o_a_proj.weight"].view(2, 12, 4, 16)[g][:, kept[kept // 4 == g] % 4]
            for g in (0, 1)
        ]
    ).reshape(24, 32)
    torch.testing.assert_close(cut.o_a_proj.weight, want, rtol=0, atol=0)
    rows = (kept[:, None] * 16 + torch.arange(16)).flatten()
    torch.testing.assert_close(cut.q_b_proj.weight, dense["q_b_proj.weight"][rows], rtol=0, atol=0)
    torch.testing.assert_close(cut.sinks, dense["sinks"][kept], rtol=0, atol=0)
    torch.testing.assert_close(cut.kv_proj.weight, dense["kv_proj.weight"], rtol=0, atol=0)
    assert (cut.num_heads, cut.num_key_value_groups, exported.config.num_attention_heads) == (
        4,
        4,
        4,
    )
    assert pruner.predicted_counts()[0] == count_params(exported)


def test_deepseek_v4_compressed_query_prunes_through_its_rms_norm():
    """DeepSeek-V4's compressed query q_a_proj feeds an RMS norm over its width, then
    q_b_proj: a channel group of its own, the norm cut and rescaled with q_a_proj's rows
    (channel_rms_norms.py), with the heads and experts under a float ratio; the export
    computes what the hard-masked model does and q_lora_rank describes it."""
    model, inputs = tiny_deepseek_v4(), (tokens(),)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    latents = {g.name: g for g in pruner.groups if g.name.endswith("q_a_proj")}
    assert list(latents) == [f"model.layers.{i}.self_attn.q_a_proj" for i in (0, 1)]
    for name, group in latents.items():
        norm = model.get_submodule(name.replace("q_a_proj", "q_a_norm"))
        assert group.rms_norms == [(norm, model.get_submodule(name))]
    exported, _ = described_export(pruner, model, inputs)
    assert pruner.predicted_counts()[0] == count_params(exported)
    assert exported.config.q_lora_rank == 10
    assert exported.model.layers[1].self_attn.q_b_proj.in_features == 10


def test_grouped_output_projection_refuses_a_count_its_groups_cannot_keep_alike():
    """3 of 8 heads cannot be kept as many in each of 2 groups: an error naming the layer
    and ratios every such layer can keep, before anything changes."""
    model, inputs = tiny_deepseek_v4(), (tokens(),)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn': ratio 0.6 keeps 3 of 8"):
        DTPPruner(model, inputs, {"heads": 0.6})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())


def test_latent_attention_is_recognised_by_all_its_parts_and_checked_whole():
    """Without its key/value latent it is not latent attention; a value head size that
    does not divide o_proj's inputs is an error naming the layer."""
    from dtp_kernels.pruning.attention_forms import _latent

    attn = tiny_deepseek().model.layers[0].self_attn
    assert _latent("attn", attn).units == 4
    attn.v_head_dim = 5
    with pytest.raises(ValueError, match=r"latent attention layer 'attn': .* not 4 heads"):
        _latent("attn", attn)
    del attn.kv_a_proj_with_mqa
    assert _latent("attn", attn) is None


def test_mamba_projections_left_to_the_graph_are_left_whole():
    """Mamba's mixers not taken as Mamba groups (ignored here): the graph maps their
    projections' channels through the selective scan's reshapes past a layer's width,
    so their groups are left whole, and a ratio naming one is refused by name, the model
    untouched."""
    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4, **TOKEN_IDS
    )
    model = transformers.MambaForCausalLM(config)
    mixers = [layer.mixer for layer in model.backbone.layers]
    with pytest.raises(ValueError, match=r"names \['backbone.layers.0.mixer.in_proj'\], which"):
        DTPPruner(
            model, (tokens(),), {"backbone.layers.0.mixer.in_proj": 0.5}, ignored_layers=mixers
        )
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())


class RoutedBlock(torch.nn.Module):
    """A block holding attention of 4 heads beside a layer of 4 outputs per token (a
    router, say) that has nothing to do with the heads."""

    def __init__(self):
        super().__init__()
        self.attn, self.router = TalkingHeads(mixed=False), torch.nn.Linear(32, 4)

    def forward(self, x):
        return x + self.attn(x) * self.router(x).softmax(-1)[..., :1]


def test_a_layer_beside_the_attention_with_as_many_outputs_as_heads_is_no_table():
    """Only raw parameters beside the attention are per-head tables: the block's router
    (weights 4 x 32 with 4 heads) stays whole and the heads export exactly."""
    torch.manual_seed(0)
    model, inputs = torch.nn.Sequential(RoutedBlock()), (torch.randn(2, 5, 32),)
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    assert [(g.name, g.tables) for g in pruner.groups] == [("0.attn", [])]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, inputs)
    assert exported[0].router.weight.shape == (4, 32)


def wav2vec2_conformer(position_embeddings_type: str):
    return tiny_speech_encoder(
        "Wav2Vec2Conformer",
        conv_depthwise_kernel_size=3,
        position_embeddings_type=position_embeddings_type,
    ).eval()


def test_wav2vec2_conformer_heads_with_relative_positions():
    """Wav2Vec2-Conformer's linear_q/k/v/out with head_size: with relative positions,
    linear_pos projects the position embeddings head by head (its rows cut with the
    heads) and pos_bias_u, pos_bias_v hold a row per head (cut too); the export equals
    the hard-masked model. With rotary embeddings, which turn the layer's input split
    into its heads, export gives the layers a class that splits it by the head size
    (the input keeps the model width): with every head kept it computes what
    transformers' does, and the pruned export equals the hard-masked model."""
    model = wav2vec2_conformer("relative")
    wave = torch.randn(2, 4000, generator=torch.Generator().manual_seed(1))
    pruner = DTPPruner(model, (wave[:1],), {"heads": 0.5})
    layers = "wav2vec2_conformer.encoder.layers"
    assert [g.name for g in pruner.groups] == [f"{layers}.{i}.self_attn" for i in (0, 1)]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, model, (wave,))
    attention = exported.get_submodule(f"{layers}.0.self_attn")
    assert attention.linear_pos.out_features == attention.linear_q.out_features == 16
    assert attention.pos_bias_u.shape == attention.pos_bias_v.shape == (2, 8)
    assert attention.num_heads == 2
    rotary = wav2vec2_conformer("rotary")
    with torch.no_grad():
        want = rotary(wave).logits
        for layer in rotary.wav2vec2_conformer.encoder.layers:
            PrunedWav2Vec2ConformerSelfAttention.from_dense(layer.self_attn)
        torch.testing.assert_close(rotary(wave).logits, want, rtol=0, atol=0)
    pruner = DTPPruner(rotary, (wave[:1],), {"heads": 0.5})
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = export_checked(pruner, rotary, (wave,))
    attention = exported.get_submodule(f"{layers}.1.self_attn")
    assert type(attention) is PrunedWav2Vec2ConformerSelfAttention
    assert attention.num_heads == 2 and attention.linear_q.out_features == 16
    assert count_params(exported) == pruner.report()["params_after"]


def codegen(heads: int = 16):
    config = transformers.CodeGenConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=heads, rotary_dim=4, **TOKEN_IDS
    )
    return transformers.CodeGenForCausalLM(config).eval(), (tokens(),)


def test_codegen_heads_prune_as_many_from_each_shard():
    """CodeGen's qkv_proj is interleaved over the 4 shards it was trained on (each
    shard's queries, values and keys of its heads) and its code splits it into 4 equal
    parts: each shard is a transport segment keeping as many heads, the rows cut shard
    by shard, `embed_dim` written with the kept width. A count the shards cannot keep
    alike, a budget over several groups, and shards of one head each are refused by
    name, with nothing mutated."""
    torch.manual_seed(0)
    model, inputs = codegen()
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    assert [(g.name, g.size, g.segments) for g in pruner.groups] == [
        (f"transformer.h.{i}.attn", 16, 4) for i in (0, 1)
    ]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    masks = pruner.hard_masks()
    assert all(mask.view(4, 4).sum(1).tolist() == [2.0] * 4 for mask in masks)
    exported = export_checked(pruner, model, inputs)
    attention = exported.transformer.h[0].attn
    assert (attention.qkv_proj.out_features, attention.embed_dim) == (96, 32)
    assert attention.num_attention_heads == 8
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    pruner.remove()
    with pytest.raises(ValueError, match=r"ratio 0.3 keeps 11 of 16 heads in 4 groups of 4"):
        DTPPruner(model, inputs, {"heads": 0.3})
    with pytest.raises(ValueError, match=r"budget = 'global' cannot keep the same number"):
        DTPPruner(model, inputs, {"heads": 0.5}, budget="global")
    alone, inputs = codegen(heads=4)
    with pytest.raises(ValueError, match=r"each of its shards holds one head"):
        DTPPruner(alone, inputs, {"heads": 0.5})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
