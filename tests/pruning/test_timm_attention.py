"""timm_attention.py: timm's attention layers that reshape their heads' output to the
model width (EVA's: EVA-02, DINOv3, Perception Encoder, RoPE-ViT; BEiT's; Swin V2's;
DaViT's; XCiT's and EdgeNeXt's cross-covariance attention; VOLO's; the relative-position
ViT's; CaiT's and XCiT's class attention and CaiT's talking heads; NeXt-ViT's; PVT v2's
and Twins' sub-sampled and windowed attention; Swin V2 CR's; NesT's; ConViT's gated
positional attention and its self-attention; FastViT's), with heads removed. With every head kept
each pruned class computes exactly what timm's does; tiny models of each prune their
heads with a float ratio, export equal to the hard-masked model, and save and load with
a builder. Layers that prune as they are (VOLO's class attention, MaxxViT's attention in
both layouts) are tested here too."""

from functools import partial

import pytest
import torch

from dtp_kernels import DTPPruner, load_pruned, save_pruned
from dtp_kernels.pruning import built_model
from dtp_kernels.pruning.cost import count_params
from utils import check_export, randomised

timm = pytest.importorskip("timm")
from timm.layers import AttentionPool2d, RotaryEmbeddingCat  # noqa: E402
from timm.layers.pos_embed_rel import RelPosBias, RelPosBiasTf, RelPosMlp  # noqa: E402
from timm.models.beit import Attention as BeitAttention  # noqa: E402
from timm.models.cait import ClassAttn, TalkingHeadAttn  # noqa: E402
from timm.models.convit import GPSA, MHSA  # noqa: E402
from timm.models.davit import ChannelAttention  # noqa: E402
from timm.models.davit import WindowAttention as DavitWindowAttention  # noqa: E402
from timm.models.edgenext import CrossCovarianceAttn  # noqa: E402
from timm.models.eva import EvaAttention  # noqa: E402
from timm.models.fastvit import Attention as FastVitAttention  # noqa: E402
from timm.models.maxxvit import AttentionCl  # noqa: E402
from timm.models.nest import Attention as NestAttention  # noqa: E402
from timm.models.nextvit import EfficientAttention  # noqa: E402
from timm.models.pvt_v2 import Attention as PvtV2Attention  # noqa: E402
from timm.models.swin_transformer_v2 import WindowAttention  # noqa: E402
from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention  # noqa: E402
from timm.models.twins import GlobalSubSampleAttn, LocallyGroupedAttn  # noqa: E402
from timm.models.vision_transformer_relpos import RelPosAttention  # noqa: E402
from timm.models.volo import Attention as VoloAttention  # noqa: E402
from timm.models.volo import ClassAttention as VoloClassAttention  # noqa: E402
from timm.models.xcit import XCA  # noqa: E402

from dtp_kernels.pruning.timm_attention import PRUNED_CLASSES  # noqa: E402

TOKENS = 11  # two prefix tokens and a 3 x 3 grid; Swin V2's: one 3 x 3 window


def eva(**kwargs):
    return EvaAttention(32, num_heads=4, num_prefix_tokens=2, scale_norm=False, **kwargs)


def rope():
    return {"rope": RotaryEmbeddingCat(8, in_pixels=False, feat_shape=[3, 3]).get_embed()}


def attention_mask():
    mask = torch.rand(2, 1, TOKENS, TOKENS) > 0.3
    mask[..., 0] = True  # every query attends to something
    return {"attn_mask": mask}


def image_of_tokens(argument):  # PVT v2's and Twins' layers are told the 3 x 3 image
    return lambda: {argument: (3, 3)}


def shifted_windows():  # Swin V2's mask per window: 0 or -100
    return {"mask": (torch.rand(2, 9, 9) > 0.5).float() * -100}


# (layer, call) per form: each projection form, rotary embeddings with prefix tokens,
# masks, causal attention, relative position tables, a bias shared from outside
LAYERS = {
    "eva q and v biases": (lambda: eva(qkv_bias=True), dict),
    "eva biases added apart": (lambda: eva(qkv_bias=True, qkv_bias_separate=True), dict),
    "eva no bias, rope": (lambda: eva(qkv_bias=False), rope),
    "eva rope rotating halves": (lambda: eva(rotate_half=True), rope),
    "eva separate projections": (lambda: eva(qkv_fused=False), attention_mask),
    "eva gated": (lambda: eva(gated=True), dict),
    "eva query and key norms": (
        lambda: eva(qk_norm=True, norm_layer=torch.nn.LayerNorm),
        lambda: {"is_causal": True},
    ),
    "beit table": (lambda: BeitAttention(32, 4, qkv_bias=True, window_size=(3, 3)), dict),
    "beit shared bias": (
        lambda: BeitAttention(32, 4, qkv_bias=True, window_size=(3, 3)),
        lambda: {"shared_rel_pos_bias": torch.randn(1, 4, 10, 10)},
    ),
    "beit no table, no bias": (lambda: BeitAttention(32, 4), dict),
    "swin v2": (lambda: WindowAttention(32, (3, 3), 4), dict),
    "swin v2 shifted, no bias": (lambda: WindowAttention(32, (3, 3), 4, False), shifted_windows),
    "davit channel": (lambda: ChannelAttention(32, 4, qkv_bias=True), dict),
    "davit window": (lambda: DavitWindowAttention(32, (3, 3), 4), dict),
    "xcit": (lambda: XCA(32, 4, qkv_bias=True), dict),
    "edgenext": (lambda: CrossCovarianceAttn(32, 4, qkv_bias=True), dict),
    "volo": (lambda: VoloAttention(32, 4, qkv_bias=True), dict),  # on a 3 x 3 image
    "class attention": (lambda: ClassAttn(32, 4, qkv_bias=True), dict),
    # CaiT's: the heads' logits, then their weights, mixed across heads
    "talking heads": (lambda: TalkingHeadAttn(32, 4, qkv_bias=True), dict),
    # keys and values from the tokens pooled (2 of 11) and batch-normalized
    "nextvit": (lambda: EfficientAttention(32, head_dim=8), dict),
    "nextvit pooled": (lambda: EfficientAttention(32, head_dim=8, sr_ratio=2).eval(), dict),
    # keys and values from all tokens, from the tokens reduced by a strided convolution
    # (2 x 2 to 1) and normalized, or pooled (to 7 x 7), reduced, normalized and activated
    "pvt v2": (lambda: PvtV2Attention(32, 4), image_of_tokens("feat_size")),
    "pvt v2 sub-sampled": (lambda: PvtV2Attention(32, 4, sr_ratio=2), image_of_tokens("feat_size")),
    "pvt v2 linear": (
        lambda: PvtV2Attention(32, 4, linear_attn=True),
        image_of_tokens("feat_size"),
    ),
    "twins global": (lambda: GlobalSubSampleAttn(32, 4), image_of_tokens("size")),
    "twins global sub-sampled": (
        lambda: GlobalSubSampleAttn(32, 4, sr_ratio=2),
        image_of_tokens("size"),
    ),
    # scaled cosine attention, a bias per head from the meta MLP (eval: its dropout)
    "swin v2 cr": (lambda: WindowMultiHeadAttention(32, 4, (3, 3)).eval(), dict),
    "swin v2 cr shifted": (
        lambda: WindowMultiHeadAttention(32, 4, (3, 3)).eval(),
        shifted_windows,
    ),
    # each head's patch attention mixed with its positional attention by its gate (a 3 x 3
    # image of tokens), then plain self-attention
    "convit gated": (lambda: GPSA(32, 4, qkv_bias=True), dict),
    "convit": (lambda: MHSA(32, 4, qkv_bias=True), dict),
    # over 2 image blocks of 9 tokens; its heads' outputs merged with the head innermost
    "nest": (lambda: NestAttention(32, 4, qkv_bias=True), dict),
    "fastvit": (lambda: FastVitAttention(32, head_dim=8), dict),  # on a 3 x 3 image, NCHW
    # windows of 2 x 2 over the 3 x 3 image: padded to 4 x 4
    "twins local": (lambda: LocallyGroupedAttn(32, 4, ws=2), image_of_tokens("size")),
    # a position bias made by an MLP with an output per head, or read from a table; the
    # prefix token padded with zero bias
    "relpos mlp": (
        # eval: the bias MLP's dropout would draw apart
        lambda: RelPosAttention(
            32, 4, True, rel_pos_cls=partial(RelPosMlp, window_size=(3, 3))
        ).eval(),
        dict,
    ),
    "relpos bias, prefix": (
        lambda: RelPosAttention(
            32, 4, rel_pos_cls=partial(RelPosBias, window_size=(3, 3), prefix_tokens=1)
        ),
        dict,
    ),
}


@pytest.mark.parametrize("case", list(LAYERS))
@pytest.mark.parametrize("fused_attn", [True, False])
def test_every_head_kept_computes_what_timm_computes(case, fused_attn):
    """Bitwise the same outputs and parameter gradients as timm's layer."""
    build, call = LAYERS[case]
    torch.manual_seed(0)
    layer = build()
    layer.fused_attn = fused_attn
    for p in layer.parameters():  # biases and tables away from their zero initial values
        torch.nn.init.normal_(p, std=0.5)
    if hasattr(layer, "logit_scale"):  # one head's scale past its clamp (log 100)
        layer.logit_scale.data[0] = 5.0
    tokens = TOKENS - 1 if case.startswith(("beit", "relpos bias")) else TOKENS
    batch = 4 if case.startswith("swin v2 shifted") else 2
    windowed = case.startswith(("swin", "davit window", "relpos mlp", "pvt", "twins", "convit"))
    shape = (batch, 3, 3) if case == "volo" else (batch, 9 if windowed else tokens)
    shape = (batch, 2, 9) if case == "nest" else shape
    x = torch.randn(*shape, 32, requires_grad=True)
    if case == "fastvit":  # channels first
        x = torch.randn(batch, 32, 3, 3, requires_grad=True)
    extra = call()
    want = layer(x, **extra)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    PRUNED_CLASSES[type(layer)].from_dense(layer)
    got = layer(x, **extra)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    if getattr(layer, "q_bias", None) is not None:
        assert layer.k_bias is None and "k_bias" not in dict(layer.named_buffers())


SMALL = dict(img_size=16, patch_size=4, embed_dim=32)  # ViTs of 16 tokens
MODELS = {
    # EVA-02: q and v biases kept outside the fused projection, rotary embeddings
    "eva02": (
        "timm.models.eva:Eva",
        dict(**SMALL, depth=2, num_heads=4, use_rot_pos_emb=True, ref_feat_shape=(4, 4)),
    ),
    # DINOv3: no bias, register tokens, DINOv3 rotary embeddings rotating halves
    "dinov3": (
        "timm.models.eva:Eva",
        dict(
            **SMALL,
            depth=2,
            num_heads=4,
            qkv_bias=False,
            use_rot_pos_emb=True,
            use_abs_pos_emb=False,
            rope_type="dinov3",
            rope_rotate_half=True,
            num_reg_tokens=2,
            init_values=1e-5,
        ),
    ),
    # separate query, key and value projections
    "eva unfused": ("timm.models.eva:Eva", dict(**SMALL, depth=2, num_heads=4, qkv_fused=False)),
    # a relative position bias table per layer
    "beit": ("timm.models.beit:Beit", dict(**SMALL, depth=2, num_heads=4, use_rel_pos_bias=True)),
    # a window attention and a channel attention (heads attend over their channels)
    "davit": (
        "timm.models.davit:DaVit",
        dict(depths=(1,), embed_dims=(32,), num_heads=(4,), window_size=2),
    ),
    "swin v2": (
        "timm.models.swin_transformer_v2:SwinTransformerV2",
        dict(depths=(2,), num_heads=(4,), window_size=2, img_size=16, patch_size=2, embed_dim=32),
    ),
    # a temperature per head, then a class attention block (CaiT's ClassAttn)
    "xcit": (
        "timm.models.xcit:Xcit",
        dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=4, cls_attn_layers=1),
    ),
    # a temperature per head, in two of the four stages
    "edgenext": (
        "timm.models.edgenext:EdgeNeXt",
        dict(
            depths=(1, 1, 1, 1),
            dims=(16, 16, 32, 32),
            global_block_counts=(0, 1, 0, 1),
            kernel_sizes=(3,) * 4,
            heads=(4,) * 4,
            d2_scales=(2,) * 4,
            ls_init_value=1.0,
        ),
    ),
    # outlook attention (no heads to cut), then self-attention over an image of tokens
    "volo": (
        "timm.models.volo:VOLO",
        dict(
            layers=(1, 2),
            img_size=16,
            patch_size=8,
            embed_dims=(32, 32),
            num_heads=(2, 4),
            outlook_attention=(True, False),
            downsamples=(False, False),
            stem_hidden_dim=16,
        ),
    ),
}
# a position bias per layer, made by an MLP or read from a table
for rel_pos_type in ("mlp", "bias"):
    MODELS[f"relpos {rel_pos_type}"] = (
        "timm.models.vision_transformer_relpos:VisionTransformerRelPos",
        dict(**SMALL, depth=2, num_heads=4, rel_pos_type=rel_pos_type, class_token=True),
    )
# keys and values pooled, then batch-normalized, in its first two attention layers; its
# stage widths are fixed (the smallest of its transformer blocks has 6 heads)
MODELS["nextvit"] = ("timm.models.nextvit:NextViT", dict(in_chans=3, depths=(1, 1, 5, 1)))
# keys and values from the tokens reduced 2 x 2 to 1 in the first stage (all tokens in
# the second), or pooled to 7 x 7 and reduced in both
for linear in (False, True):
    MODELS["pvt v2 linear" if linear else "pvt v2"] = (
        "timm.models.pvt_v2:PyramidVisionTransformerV2",
        dict(
            depths=(1, 1),
            embed_dims=(16, 32),
            num_heads=(2, 4),
            sr_ratios=(2, 1),
            mlp_ratios=(2, 2),
            linear=linear,
        ),
    )
# attention within windows of 3 x 3 (the 8 x 8 and 4 x 4 images padded), then over the
# tokens reduced 2 x 2 to 1 (Twins-SVT's layout)
MODELS["twins"] = (
    "timm.models.twins:Twins",
    dict(
        img_size=32,
        embed_dims=(16, 32),
        num_heads=(2, 4),
        mlp_ratios=(2, 2),
        depths=(2, 1),
        sr_ratios=(2, 1),
        wss=(3, 3),
    ),
)
# windows of 2 x 2 tokens, shifted in the second block
MODELS["swin v2 cr"] = (
    "timm.models.swin_transformer_v2_cr:SwinTransformerV2Cr",
    dict(img_size=(16, 16), patch_size=4, window_size=2, embed_dim=32, depths=(2,), num_heads=(4,)),
)
# 4 image blocks of 4 x 4 tokens, then 1 of 2 x 2; heads merged with the head innermost
MODELS["nest"] = (
    "timm.models.nest:Nest",
    dict(
        img_size=16,
        patch_size=2,
        num_levels=2,
        embed_dims=(16, 32),
        num_heads=(2, 4),
        depths=(1, 1),
    ),
)
# two gated positional attention layers, then one self-attention (its class token joins
# after the first two); 4 heads of 8
MODELS["convit"] = (
    "timm.models.convit:ConVit",
    dict(img_size=16, patch_size=4, embed_dim=8, depth=3, num_heads=4, local_up_to_layer=2),
)
# four stages of one block, attention in the last (2 heads of 32, on 2 x 2 positions)
MODELS["fastvit"] = (
    "timm.models.fastvit:FastVit",
    dict(
        layers=(1, 1, 1, 1),
        embed_dims=(16, 16, 32, 64),
        mlp_ratios=(2, 2, 2, 2),
        token_mixers=("repmixer", "repmixer", "repmixer", "attention"),
    ),
)
# the models' inputs: EdgeNeXt and NeXt-ViT downsample 32 times, PVT v2 and Twins 4 times
# then 2 times per stage
SIZES = {"edgenext": 64, "nextvit": 64, "pvt v2": 32, "pvt v2 linear": 32, "twins": 32}
SIZES["fastvit"] = 64
ATTENTION_LAYERS = {"nextvit": 3, "twins": 3, "convit": 3, "fastvit": 1}  # else 2
# the convolutions reducing keys' and values' tokens feed a LayerNorm: left whole
RATIOS = {name: {"*.attn.sr": 0, "*": 0.5} for name in ("pvt v2", "pvt v2 linear", "twins")}


@pytest.mark.parametrize("name", list(MODELS))
def test_models_prune_their_heads_and_save_with_a_builder(name, tmp_path):
    """A float ratio prunes every layer's heads (and the MLPs), the export computes what
    the hard-masked model computes with as many parameters as reported, each attention
    layer has the pruned class with its biases and tables cut; saved with its builder,
    it loads as the same model."""
    builder, kwargs = MODELS[name]
    kwargs = {**kwargs, "num_classes": 5}
    torch.manual_seed(0)
    model = built_model.build(builder, kwargs).eval()
    x = torch.randn(2, 3, SIZES.get(name, 16), SIZES.get(name, 16))
    pruner = DTPPruner(model, (x[:1],), RATIOS.get(name, 0.5))
    attention = [m for m in model.modules() if type(m) in PRUNED_CLASSES]
    assert len(attention) == ATTENTION_LAYERS.get(name, 2)
    heads = [g.module for g in pruner.groups if getattr(g, "module", None) in attention]
    assert heads == attention
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    exported = pruner.export().eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
    pruned = [m for m in exported.modules() if type(m) in PRUNED_CLASSES.values()]
    for dense, attn in zip(attention, pruned, strict=True):
        assert type(attn) is PRUNED_CLASSES[type(dense)]
        assert attn.num_heads == dense.num_heads // 2
        assert attn.proj.in_features == dense.proj.in_features // 2
        if getattr(attn, "q_bias", None) is not None:
            assert attn.q_bias.shape == attn.v_bias.shape == (attn.proj.in_features,)
        if hasattr(attn, "temperature"):  # XCiT's and EdgeNeXt's, one per head
            assert attn.temperature.shape == (2, 1, 1)
        if hasattr(attn, "meta_mlp"):  # Swin V2 CR's bias and scale per head
            assert attn.meta_mlp.fc2.out_features == attn.logit_scale.shape[0] == 2
        if hasattr(attn, "gating_param"):  # ConViT's gate and positional row per head
            assert attn.pos_proj.out_features == attn.gating_param.shape[0] == 2
    path = tmp_path / "model.safetensors"
    save_pruned(path, exported, builder=builder, builder_kwargs=kwargs)
    loaded = load_pruned(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), exported(x), rtol=0, atol=0)
    exported.train()(x).sum().backward()  # it trains on


def test_convit_with_its_heads_whole_saves_with_a_builder(tmp_path):
    """ConViT's gated attention makes its relative positions (a buffer not saved) at its
    first forward: a model whose heads were left whole (the MLPs pruned) and that has run
    saves with its builder too, and loads as the same model."""
    builder, kwargs = MODELS["convit"]
    kwargs = {**kwargs, "num_classes": 5}
    torch.manual_seed(0)
    model = built_model.build(builder, kwargs).eval()
    x = torch.randn(2, 3, 16, 16)
    exported = DTPPruner(model, (x[:1],), {"mlp": 0.5}).export().eval()
    assert type(exported.blocks[0].attn) is GPSA
    with torch.no_grad():
        want = exported(x)  # the relative positions made for its 16 tokens
    save_pruned(tmp_path / "model.safetensors", exported, builder=builder, builder_kwargs=kwargs)
    with torch.no_grad():
        got = load_pruned(tmp_path / "model.safetensors").eval()(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_attention_pool_with_separate_projections_prunes_its_heads():
    """timm's attention pool with separate q, k, v (the CLIP ResNets' head) prunes its
    heads as it is (its code reshapes them with -1): the export computes what the
    hard-masked model computes, with half the heads and the parameters and FLOPs
    reported."""
    torch.manual_seed(0)
    pool = AttentionPool2d(32, feat_size=4, out_features=5, head_dim=8, qkv_separate=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), pool).eval()
    x = torch.randn(2, 3, 4, 4)
    exported = check_export(randomised(DTPPruner(model, (x[:1],), {"heads": 0.5})), model, x)
    head = exported[1]
    assert head.num_heads == 2 and head.q.out_features == head.proj.in_features == 16


def test_volo_class_attention_prunes_its_heads_as_it_is():
    """VOLO's class attention (q of the class token, kv of all tokens: the q, kv, proj
    form, reshaped with num_heads and head_dim) prunes its heads with no class of its
    own: the export computes what the hard-masked model computes, with half the heads and
    the parameters and FLOPs reported."""
    builder, kwargs = MODELS["volo"]
    torch.manual_seed(0)
    model = built_model.build(builder, {**kwargs, "num_classes": 5}).eval()
    x = torch.randn(2, 3, 16, 16)
    pruner = randomised(DTPPruner(model, (x[:1],), {"heads": 0.5}))
    names = [n for n, m in model.named_modules() if type(m) is VoloClassAttention]
    assert len(names) == 2 and set(names) <= {g.name for g in pruner.groups}
    exported = check_export(pruner, model, x)
    for name in names:
        layer = exported.get_submodule(name)
        assert type(layer) is VoloClassAttention
        assert layer.num_heads == 2 and layer.kv.out_features == 2 * layer.q.out_features == 32


class WindowOfTokens(torch.nn.Module):
    """timm MaxxViT's channels-last attention over a 3 x 3 window of tokens, before a
    classifier."""

    def __init__(self, head_first: bool, rel_pos) -> None:
        super().__init__()
        rel_pos_cls = partial(rel_pos, window_size=(3, 3))
        self.attn = AttentionCl(32, dim_head=8, head_first=head_first, rel_pos_cls=rel_pos_cls)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x).mean(dim=(1, 2)))


@pytest.mark.parametrize("rel_pos", [RelPosBias, RelPosMlp, RelPosBiasTf])
@pytest.mark.parametrize("head_first", [True, False])
def test_maxxvit_attention_prunes_its_heads_in_either_layout(head_first, rel_pos):
    """MaxxViT's attention holds each head's query, key and value in turn (`head_first`)
    or all queries, then keys, then values, and takes its bias per head from a position
    module (a table, an MLP or TF's table) that shapes the bias by its own head count:
    the heads prune with no class of their own, that count and shape written, the export
    equal to the hard-masked model with the parameters reported."""
    torch.manual_seed(0)
    model = WindowOfTokens(head_first, rel_pos).eval()
    for p in model.attn.rel_pos.parameters():  # a bias away from its zero initial values
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 3, 3, 32)
    pruner = randomised(DTPPruner(model, (x[:1],), {"heads": 0.5}))
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
    attn = exported.attn
    assert attn.num_heads == 2 and attn.qkv.out_features == 48
    assert attn.rel_pos.get_bias().shape[-3] == 2  # (1,) heads, tokens, tokens


class OddHeadCount(ClassAttn):
    """Class attention whose num_heads (3) does not divide its width (32); its forward
    runs on 4 heads, as a layer whose count means something else would."""

    def __init__(self) -> None:
        super().__init__(32, 4)
        self.num_heads = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.num_heads = 4
        try:
            return super().forward(x)
        finally:
            self.num_heads = 3


def test_class_attention_whose_width_does_not_split_into_its_heads_is_refused_by_name():
    """The class attention form takes its head size from num_heads: a width that is not a
    whole number of them has none, and asking for the heads is refused naming the layer,
    the width and the count."""
    model = torch.nn.Sequential(OddHeadCount(), torch.nn.Flatten(), torch.nn.Linear(32, 5))
    refused = r"'0': proj \(32 inputs\) does not split into its num_heads 3"
    with pytest.raises(ValueError, match=refused):
        DTPPruner(model, (torch.randn(1, TOKENS, 32),), {"heads": 0.5})


class GatedEva(torch.nn.Module):
    """An EVA attention layer with an output gate (`gated`: sigmoid(gate(x)) scales each
    channel of the heads' output) before a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = eva(gated=True)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x).mean(dim=1))


def test_an_output_gate_named_gate_is_cut_with_the_heads():
    torch.manual_seed(0)
    model = GatedEva().eval()
    x = torch.randn(2, TOKENS, 32)
    pruner = DTPPruner(model, (x[:1],), {"heads": 0.5})
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    exported = pruner.export().eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert exported.attn.gate.out_features == exported.attn.proj.in_features == 16
    assert count_params(exported) == pruner.report()["params_after"]


def test_a_timm_without_these_classes_gives_none_and_their_heads_are_refused(monkeypatch):
    """With a timm that lacks a class timm_attention.py subclasses (an older version),
    no pruned class is given: EVA's heads fail their proof and are refused by name, and
    other models' heads still prune."""
    import sys

    from dtp_kernels.pruning.pruned_classes import pruned_classes

    monkeypatch.delitem(sys.modules, "dtp_kernels.pruning.timm_attention")
    monkeypatch.delattr(timm.models.davit, "ChannelAttention")  # its import then fails
    assert not any(c.__module__.startswith("timm") for c in pruned_classes())
    torch.manual_seed(0)
    kwargs = dict(**SMALL, depth=1, num_heads=4, num_classes=5)
    model = built_model.build("timm.models.eva:Eva", kwargs)
    with pytest.raises(ValueError, match=r"attention layer 'blocks.0.attn': with some of"):
        DTPPruner(model, (torch.randn(1, 3, 16, 16),), {"heads": 0.5})
    deit = built_model.build("timm.models.vision_transformer:VisionTransformer", kwargs)
    DTPPruner(deit, (torch.randn(1, 3, 16, 16),), {"heads": 0.5}).export()


@pytest.mark.parametrize("name", ["dinov3", "davit", "xcit", "volo", "twins"])
def test_an_exported_model_compiles_whole(name):
    """torch.compile takes an exported model with the pruned classes in one graph
    (fullgraph) and computes what it computes eagerly."""
    builder, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = built_model.build(builder, {**kwargs, "num_classes": 5}).eval()
    x = torch.randn(2, 3, SIZES.get(name, 16), SIZES.get(name, 16))
    exported = DTPPruner(model, (x[:1],), RATIOS.get(name, 0.5)).export().eval()
    compiled = torch.compile(exported, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), exported(x), rtol=1e-5, atol=1e-6)


class UnevenKeysValues(torch.nn.Module):
    """PVT v2's attention whose kv projection (48 outputs) is not the keys and values of
    its 4 heads of 8 (64), before a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = PvtV2Attention(32, 4)
        self.attn.kv = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=1))  # the layer's forward would fail on its shapes


def test_a_key_value_projection_that_does_not_split_into_the_heads_is_refused_by_name():
    """The q, kv, proj form reads kv as every head's key, then every head's value: a kv
    of another width is refused giving the widths (this layer cannot run: the pruner
    leaves it whole as a layer the example never runs, and has no heads to prune)."""
    from dtp_kernels.pruning.attention_forms import match_form

    model = UnevenKeysValues()
    group = match_form("attn", model.attn)
    assert group.refusal.startswith("q (32 outputs), kv (48 outputs) and proj (32 inputs)")
    with pytest.raises(ValueError, match=r"ratios asks to prune \['heads'\]"):
        DTPPruner(model, (torch.randn(1, 9, 32),), {"heads": 0.5})


def test_nest_masks_each_heads_channels_where_its_code_puts_them():
    """NesT merges its heads' outputs with the head innermost: under the hard masks the
    output projection's column c * heads + h is zeroed exactly when head h is removed,
    and in training the soft masks give every head's score a gradient."""
    builder, kwargs = MODELS["nest"]
    torch.manual_seed(0)
    model = built_model.build(builder, {**kwargs, "num_classes": 5})
    x = torch.randn(2, 3, 16, 16)
    pruner = randomised(DTPPruner(model, (x[:1],), {"heads": 0.5}))
    layer = model.levels[1].transformer_encoder[0].attn
    index = next(i for i, g in enumerate(pruner.groups) if g.module is layer)
    dense = layer.proj.parametrizations.weight.original.detach().clone()
    mask = pruner.hard_masks()[index]  # one entry per head: 4
    with torch.no_grad(), pruner.hard_masked():
        masked = layer.proj.weight.clone()
    torch.testing.assert_close(masked, dense * mask.repeat(8), rtol=0, atol=0)
    model.train()(x).square().sum().backward()
    start = sum(g.size for g in pruner.groups[:index])
    assert torch.all(pruner.scores.grad[start : start + 4] != 0)
