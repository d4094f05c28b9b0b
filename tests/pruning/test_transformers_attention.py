"""transformers_attention.py: Hugging Face attention layers that reshape their heads'
output to the model width (TrOCR's, PVT v2's, Table Transformer's, Mask2Former's and
OneFormer's), with heads removed. With every head kept the pruned class computes exactly
what transformers' does; a tiny TrOCR (a ViT encoder and a TrOCR decoder) prunes its
decoder's self- and cross-attention heads, exports equal to the hard-masked model and
generates the same tokens through the key/value cache; a tiny PVT v2 prunes its heads
and exports equal to the hard-masked model, as do the positioned attention layers and a
tiny Mask2Former (its cross-attention handed a mask per head too)."""

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.heads import HeadGroup

transformers = pytest.importorskip("transformers")
from transformers.models.mask2former.modeling_mask2former import (  # noqa: E402
    Mask2FormerAttention,
)
from transformers.models.oneformer.modeling_oneformer import OneFormerAttention  # noqa: E402
from transformers.models.pvt_v2.modeling_pvt_v2 import PvtV2SelfAttention  # noqa: E402
from transformers.models.table_transformer.modeling_table_transformer import (  # noqa: E402
    TableTransformerAttention,
)
from transformers.models.trocr.modeling_trocr import TrOCRAttention  # noqa: E402

from dtp_kernels.pruning.transformers_attention import (  # noqa: E402
    PRUNED_CLASSES,
    PrunedMask2FormerAttention,
    PrunedPvtV2SelfAttention,
    PrunedTrOCRAttention,
)
from utils import HFLogits, check_export, randomised  # noqa: E402

DECODER = dict(
    vocab_size=64,
    d_model=32,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=64,
    cross_attention_hidden_size=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def attention_mask() -> torch.Tensor:
    mask = torch.zeros(2, 1, 5, 5)
    mask[:, :, :, -2:] = torch.finfo(torch.float32).min  # two padded tokens
    return mask


# (is cross-attention, call extras) per case
CASES = {
    "self": (False, dict),
    "self, masked, weights": (
        False,
        lambda: {"attention_mask": attention_mask(), "output_attentions": True},
    ),
    "cross": (True, lambda: {"key_value_states": torch.randn(2, 7, 32)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_head_kept_computes_what_transformers_computes(case):
    """Bitwise the same outputs, attention weights and parameter gradients."""
    cross, call = CASES[case]
    torch.manual_seed(0)
    config = transformers.TrOCRConfig(**DECODER)
    layer = TrOCRAttention(config, 32, 4, is_decoder=True, is_cross_attention=cross)
    x = torch.randn(2, 5, 32, requires_grad=True)
    extra = call()
    want = layer(x, **extra)
    want_grads = torch.autograd.grad(want[0].square().sum(), [x, *layer.parameters()])
    PrunedTrOCRAttention.from_dense(layer)
    got = layer(x, **extra)
    got_grads = torch.autograd.grad(got[0].square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def tiny_trocr():
    """A VisionEncoderDecoderModel of a one-layer ViT and a two-layer TrOCR decoder."""
    encoder = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
    )
    decoder = transformers.TrOCRConfig(**DECODER, decoder_start_token_id=1)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return transformers.VisionEncoderDecoderModel(config).eval()


def test_trocr_heads_export_equal_to_the_hard_masked_model_and_generate():
    """Every decoder layer's self- and cross-attention keeps 2 of its 4 heads as the
    pruned class; the export computes the hard-masked model's logits, generates its
    tokens through the cache (the cross-attention's keys and values written once), and
    has the parameters the pruner predicts."""
    torch.manual_seed(0)
    model = tiny_trocr()
    pixels = torch.randn(2, 3, 16, 16)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    pruner = DTPPruner(model, (pixels[:1], ids[:1]), {"heads": 0.5, "mlp": 0.5})
    decoder = model.decoder.model.decoder
    attention = [a for layer in decoder.layers for a in (layer.self_attn, layer.encoder_attn)]
    heads = [g.module for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [h for h in heads if h in attention] == attention
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), pruner.hard_masked():
        want = model(pixel_values=pixels, decoder_input_ids=ids).logits
        tokens = model.generate(pixels, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    exported = pruner.export().eval()
    with torch.no_grad():
        got = exported(pixel_values=pixels, decoder_input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    generated = exported.generate(
        pixels, max_new_tokens=5, min_new_tokens=5, do_sample=False, return_dict_in_generate=True
    )
    assert torch.equal(generated.sequences, tokens)
    # the cross-attention keys written once, at the first step: the encoder's 17 tokens
    assert generated.past_key_values.cross_attention_cache.get_seq_length() == 17
    for layer in exported.decoder.model.decoder.layers:
        for attn in (layer.self_attn, layer.encoder_attn):
            assert type(attn) is PrunedTrOCRAttention
            assert attn.num_heads == 2 and attn.out_proj.in_features == 16
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def pvt_v2_config(linear: bool) -> transformers.PvtV2Config:
    """Two stages of one block: 2 heads of 8 over an 8 x 8 image of tokens whose keys and
    values come from it reduced 2 x 2 to 1, then 4 heads of 8 over a 4 x 4 image (keys
    and values from all its tokens); linear: both pooled to 7 x 7 first."""
    return transformers.PvtV2Config(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        num_attention_heads=[2, 4],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
        linear_attention=linear,
        num_labels=5,
    )


@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("sr_ratio", [1, 2])
@pytest.mark.parametrize("output_attentions", [False, True])
def test_every_head_kept_computes_what_pvt_v2_computes(linear, sr_ratio, output_attentions):
    """Bitwise the same outputs, attention weights and parameter gradients as PVT v2's
    layer, its keys and values from all tokens, from the tokens reduced, or pooled."""
    torch.manual_seed(0)
    layer = PvtV2SelfAttention(pvt_v2_config(linear), 32, 4, sr_ratio)
    x = torch.randn(2, 16, 32, requires_grad=True)
    want = layer(x, 4, 4, output_attentions)
    want_grads = torch.autograd.grad(want[0].square().sum(), [x, *layer.parameters()])
    PrunedPvtV2SelfAttention.from_dense(layer)
    got = layer(x, 4, 4, output_attentions)
    got_grads = torch.autograd.grad(got[0].square().sum(), [x, *layer.parameters()])
    assert len(got) == len(want) == (2 if output_attentions else 1)
    for g, w in zip([*got, *got_grads], [*want, *want_grads], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("linear", [False, True])
def test_pvt_v2_heads_export_equal_to_the_hard_masked_model(linear):
    """Every layer keeps half its heads as the pruned class (the reducing convolutions,
    which feed a LayerNorm, left whole); the export computes the hard-masked model's
    logits with the parameters and FLOPs reported."""
    torch.manual_seed(0)
    model = HFLogits(transformers.PvtV2ForImageClassification(pvt_v2_config(linear))).eval()
    for layer in model.modules():  # weights larger than the initial 0.02, so heads show
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            torch.nn.init.normal_(layer.weight, std=0.3)
    x = torch.randn(2, 3, 32, 32)
    ratios = {"*spatial_reduction": 0, "*": 0.5}
    pruner = randomised(DTPPruner(model, (x[:1],), ratios))
    attention = [m for m in model.modules() if isinstance(m, PvtV2SelfAttention)]
    assert [g.module for g in pruner.groups if isinstance(g, HeadGroup)] == attention
    exported = check_export(pruner, model, x)
    pruned = [m for m in exported.modules() if isinstance(m, PvtV2SelfAttention)]
    for dense, attn in zip(attention, pruned, strict=True):
        assert type(attn) is PrunedPvtV2SelfAttention
        assert attn.num_attention_heads == dense.num_attention_heads // 2
        assert attn.proj.in_features == attn.key.out_features == dense.proj.in_features // 2


def positioned(kind: str, heads: int = 4) -> torch.nn.Module:
    """One DETR-style attention layer of width 32 (position embeddings added to its
    queries and keys): Table Transformer's, Mask2Former's or OneFormer's."""
    if kind == "table_transformer":
        return TableTransformerAttention(32, heads)
    if kind == "mask2former":
        return Mask2FormerAttention(32, heads)
    return OneFormerAttention(32, heads)


def positioned_call(kind: str, cross: bool, masked: bool) -> dict:
    """Keyword arguments of a call: batch first (Table Transformer) or tokens first, 2
    items, 5 queries, 7 sources for cross-attention; a mask of the layer's form (one
    (queries, keys) slice per item; per item and head for the tokens-first forms)."""
    generator = torch.Generator().manual_seed(2)

    def states(tokens: int) -> torch.Tensor:
        shape = (2, tokens, 32) if kind == "table_transformer" else (tokens, 2, 32)
        return torch.randn(shape, generator=generator)

    sources = 7 if cross else 5
    names = (
        ("object_queries", "spatial_position_embeddings")
        if kind == "table_transformer"
        else ("position_embeddings", "key_value_position_embeddings")
    )
    call = {"hidden_states": states(5), names[0]: states(5)}
    if cross:
        call |= {"key_value_states": states(7), names[1]: states(7)}
    if masked:
        hidden = torch.rand(2, 1, 5, sources, generator=generator) < 0.3
        hidden[..., 0] = False  # every query attends to one key at least
        if kind == "table_transformer":
            call["attention_mask"] = hidden
        else:
            bias = torch.zeros(hidden.shape).masked_fill(hidden, -1e4).expand(2, 4, 5, sources)
            call["attention_mask"] = bias.reshape(8, 5, sources)
    return call


POSITIONED = ("table_transformer", "mask2former", "oneformer")


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("kind", POSITIONED)
def test_every_head_kept_computes_what_the_positioned_attention_computes(kind, masked, cross):
    """Table Transformer's, Mask2Former's and OneFormer's attention given the pruned
    class with every head kept: bitwise the same outputs, attention weights and
    gradients."""
    torch.manual_seed(0)
    layer = positioned(kind)
    call = positioned_call(kind, cross, masked)
    call["hidden_states"].requires_grad_(True)
    inputs = [call["hidden_states"], *layer.parameters()]
    want = layer(**call, output_attentions=True)
    want_grads = torch.autograd.grad(want[0].square().sum(), inputs)
    PRUNED_CLASSES[type(layer)].from_dense(layer)
    got = layer(**call, output_attentions=True)
    got_grads = torch.autograd.grad(got[0].square().sum(), inputs)
    for g, w in zip([*got[:2], *got_grads], [*want[:2], *want_grads], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert layer(**call)[1] is None  # weights only when asked for


class OneLayer(torch.nn.Module):
    """A positioned attention layer and a linear layer after it (the model the pruner
    sees), called in the layer's own form."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.attention, self.out = kind, positioned(kind), torch.nn.Linear(32, 3)

    def forward(self, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        name = "object_queries" if self.kind == "table_transformer" else "position_embeddings"
        return self.out(self.attention(hidden_states=states, **{name: positions})[0])


@pytest.mark.parametrize("kind", POSITIONED)
def test_positioned_attention_heads_export_equal_to_the_hard_masked_model(kind):
    """A float prunes the layer's heads; export gives it the pruned class, with half its
    heads, computing what the hard-masked model computes."""
    torch.manual_seed(0)
    model = OneLayer(kind).eval()
    call = positioned_call(kind, cross=False, masked=False)
    inputs = (call["hidden_states"], next(v for k, v in call.items() if k != "hidden_states"))
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    assert [g.name for g in pruner.groups] == ["attention"]
    with torch.no_grad(), pruner.hard_masked():
        want = model(*inputs)
    exported = pruner.export().eval()
    assert type(exported.attention) is PRUNED_CLASSES[type(model.attention)]
    assert exported.attention.num_heads == 2 and exported.attention.out_proj.in_features == 16
    with torch.no_grad():
        torch.testing.assert_close(exported(*inputs), want, rtol=1e-5, atol=1e-6)


def tiny_mask2former():
    swin = transformers.SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1, 1, 1],
        num_heads=[2, 2, 2, 2],
        window_size=2,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = transformers.Mask2FormerConfig(
        backbone_config=swin,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=64,
        dim_feedforward=64,
        encoder_layers=1,
        decoder_layers=3,
        num_attention_heads=4,
        num_queries=10,
        num_labels=5,
    )
    return transformers.Mask2FormerForUniversalSegmentation(config)


class QueryLogits(torch.nn.Module):
    """Mask2Former's class and mask logits per query, from its images."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(pixel_values=images)
        return out.class_queries_logits, out.masks_queries_logits


def test_mask2former_prunes_its_heads_with_a_float():
    """Mask2Former's decoder hands its cross-attention (an nn.MultiheadAttention) a mask
    per query and head, made for the heads it was built with: the exported layer picks
    its kept heads' masks (multihead_attention.py). A float prunes the Swin backbone's
    heads, the decoder's self-attention (exported as PrunedMask2FormerAttention) and
    cross-attention, and the MLPs, the export equal to the hard-masked model."""
    torch.manual_seed(0)
    model, images = QueryLogits(tiny_mask2former()).eval(), torch.randn(1, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (images,), 0.5))
    decoder = "model.model.transformer_module.decoder.layers"
    heads = [g.name for g in pruner.groups if isinstance(g, HeadGroup)]
    for kind in ("self_attn", "cross_attn"):
        assert f"{decoder}.0.{kind}" in heads and f"{decoder}.1.{kind}" in heads
    assert any(".swin.encoder.layers.0." in name for name in heads)  # the backbone's
    with torch.no_grad(), pruner.hard_masked():
        want = model(images)
    exported = pruner.export().eval()
    self_attention = exported.get_submodule(f"{decoder}.0.self_attn")
    assert type(self_attention) is PrunedMask2FormerAttention
    assert self_attention.num_heads == 2
    cross_attention = exported.get_submodule(f"{decoder}.0.cross_attn")
    assert cross_attention.num_heads == 2 and cross_attention.kept_heads.tolist() != [0, 1]
    with torch.no_grad():
        for g, w in zip(exported(images), want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def tiny_timesformer():
    config = transformers.TimesformerConfig(
        image_size=32,
        patch_size=8,
        num_frames=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    return transformers.TimesformerForVideoClassification(config)


@pytest.mark.parametrize("output_attentions", [False, True])
def test_timesformer_attention_with_every_head_kept_is_transformers(output_attentions):
    """Bitwise the same outputs, attention weights and gradients."""
    from transformers.models.timesformer.modeling_timesformer import TimesformerSelfAttention

    torch.manual_seed(0)
    layer = TimesformerSelfAttention(tiny_timesformer().config)
    x = torch.randn(2, 5, 32, requires_grad=True)
    want = layer(x, output_attentions)
    want_grads = torch.autograd.grad(want[0].square().sum(), [x, *layer.parameters()])
    PRUNED_CLASSES[TimesformerSelfAttention].from_dense(layer)
    got = layer(x, output_attentions)
    got_grads = torch.autograd.grad(got[0].square().sum(), [x, *layer.parameters()])
    assert len(got) == len(want) == 1 + output_attentions
    for g, w in zip([*got, *got_grads], [*want, *want_grads], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_timesformer_prunes_its_space_and_time_heads():
    """TimeSformer's divided attention: each layer's attention over time and over space
    (a fused qkv of all heads' queries, keys, then values; output.dense beside it) is a
    head group; exported as PrunedTimesformerSelfAttention, equal to the hard-masked
    model."""
    torch.manual_seed(0)
    model = HFLogits(tiny_timesformer()).eval()
    video = torch.randn(2, 4, 3, 32, 32)
    pruner = randomised(DTPPruner(model, (video[:1],), 0.5))
    layers = "model.timesformer.encoder.layer"
    heads = [g.name for g in pruner.groups if isinstance(g, HeadGroup)]
    assert heads == [
        f"{layers}.{i}.{part}.attention"
        for i in (0, 1)
        for part in ("attention", "temporal_attention")
    ]
    with torch.no_grad(), pruner.hard_masked():
        want = model(video)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(video), want, rtol=1e-5, atol=1e-5)
    attention = exported.get_submodule(f"{layers}.0.temporal_attention.attention")
    assert type(attention).__name__ == "PrunedTimesformerSelfAttention"
    assert attention.num_heads == 2 and attention.qkv.out_features == 48
