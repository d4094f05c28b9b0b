"""transformers_attention.py: Hugging Face attention layers that reshape their heads'
output to the model width (TrOCR's, PVT v2's), with heads removed. With every head kept
the pruned class computes exactly what transformers' does; a tiny TrOCR (a ViT encoder and
a TrOCR decoder) prunes its decoder's self- and cross-attention heads, exports equal to
the hard-masked model and generates the same tokens through the key/value cache; a tiny
PVT v2 prunes its heads and exports equal to the hard-masked model."""

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.heads import HeadGroup

transformers = pytest.importorskip("transformers")
from transformers.models.pvt_v2.modeling_pvt_v2 import PvtV2SelfAttention  # noqa: E402
from transformers.models.trocr.modeling_trocr import TrOCRAttention  # noqa: E402

from dtp_kernels.pruning.transformers_attention import (  # noqa: E402
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
