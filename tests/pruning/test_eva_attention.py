"""eva_attention.py: timm's EVA attention (EVA-02, DINOv3, Perception Encoder, RoPE-ViT)
with heads removed. With every head kept the pruned class computes exactly what timm's
does; tiny EVA models prune their heads with a float ratio, export equal to the
hard-masked model, and save and load with a builder."""

import pytest
import torch

from dtp_kernels import DTPPruner, load_pruned, save_pruned
from dtp_kernels.pruning import built_model
from dtp_kernels.pruning.cost import count_params

timm = pytest.importorskip("timm")
from timm.layers import RotaryEmbeddingCat  # noqa: E402
from timm.models.eva import EvaAttention  # noqa: E402

from dtp_kernels.pruning.eva_attention import PrunedEvaAttention  # noqa: E402

FORMS = {
    "fused, q and v biases": dict(qkv_bias=True),
    "fused, biases added apart": dict(qkv_bias=True, qkv_bias_separate=True),
    "fused, no bias": dict(qkv_bias=False),
    "separate projections": dict(qkv_fused=False),
    "query and key norms": dict(qk_norm=True, norm_layer=torch.nn.LayerNorm, scale_norm=False),
    "rotate half": dict(rotate_half=True),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("fused_attn", [True, False])
@pytest.mark.parametrize("call", ["plain", "rope", "mask", "causal"])
def test_every_head_kept_computes_what_timm_computes(form, fused_attn, call):
    """Bitwise the same outputs and parameter gradients as timm's layer, through each
    projection form, rotary embeddings with prefix tokens, an attention mask, causal
    attention, and both attention paths."""
    torch.manual_seed(0)
    kwargs = {"scale_norm": False, **FORMS[form]}
    layer = EvaAttention(32, num_heads=4, num_prefix_tokens=2, **kwargs)
    layer.fused_attn = fused_attn
    if layer.q_bias is not None:
        torch.nn.init.normal_(layer.q_bias)
        torch.nn.init.normal_(layer.v_bias)
    x = torch.randn(2, 2 + 9, 32, requires_grad=True)
    extra = {}
    if call == "rope":
        extra["rope"] = RotaryEmbeddingCat(8, in_pixels=False, feat_shape=[3, 3]).get_embed()
    elif call == "mask":
        extra["attn_mask"] = torch.rand(2, 1, 11, 11) > 0.3
        extra["attn_mask"][..., 0] = True  # every query attends to something
    elif call == "causal":
        extra["is_causal"] = True
    want = layer(x, **extra)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    PrunedEvaAttention.from_dense(layer)
    got = layer(x, **extra)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    if layer.q_bias is not None:
        assert layer.k_bias is None and "k_bias" not in dict(layer.named_buffers())


EVA = "timm.models.eva:Eva"
EVAS = {
    # EVA-02: q and v biases kept outside the fused projection, rotary embeddings
    "eva02": dict(qkv_bias=True, use_rot_pos_emb=True, ref_feat_shape=(4, 4)),
    # DINOv3: no bias, register tokens, DINOv3 rotary embeddings rotating halves
    "dinov3": dict(
        qkv_bias=False,
        use_rot_pos_emb=True,
        use_abs_pos_emb=False,
        rope_type="dinov3",
        rope_rotate_half=True,
        num_reg_tokens=2,
        init_values=1e-5,
    ),
    # separate query, key and value projections
    "unfused": dict(qkv_fused=False, qkv_bias=True),
}


@pytest.mark.parametrize("name", list(EVAS))
def test_eva_models_prune_their_heads_and_save_with_a_builder(name, tmp_path):
    """A float ratio prunes every layer's heads (and the MLPs), the export computes what
    the hard-masked model computes with as many parameters as reported, each attention
    layer is a PrunedEvaAttention with its biases cut; saved with its builder it loads
    as the same model."""
    kwargs = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)
    kwargs |= EVAS[name]
    torch.manual_seed(0)
    model = built_model.build(EVA, kwargs).eval()
    x = torch.randn(2, 3, 16, 16)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    assert [g.name for g in pruner.groups if g.name.endswith("attn")] == [
        "blocks.0.attn",
        "blocks.1.attn",
    ]
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    exported = pruner.export().eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
    for block in exported.blocks:
        attn = block.attn
        assert type(attn) is PrunedEvaAttention and attn.num_heads == 2
        assert attn.proj.in_features == 16
        if attn.q_bias is not None:
            assert attn.q_bias.shape == attn.v_bias.shape == (16,)
    path = tmp_path / "eva.safetensors"
    save_pruned(path, exported, builder=EVA, builder_kwargs=kwargs)
    loaded = load_pruned(path).eval()
    assert type(loaded.blocks[0].attn) is PrunedEvaAttention
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), exported(x), rtol=0, atol=0)
    exported.train()(x).sum().backward()  # it trains on
