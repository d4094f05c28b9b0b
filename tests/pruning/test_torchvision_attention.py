"""torchvision_attention.py: torchvision's shifted-window attention (Swin, Swin V2, Video
Swin) and MaxViT's attention with the head size taken from the projection. With every
head kept each computes exactly what torchvision's does (values and gradients; Swin's
shifted or not, feature maps padded to whole windows or not); with heads removed, what
the hard mask computes (here for MaxViT and Video Swin; test_vision_models.py and
test_saving.py for Swin)."""

import pytest
import torch
from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.torchvision_attention import PRUNED_CLASSES, window_attention


@pytest.mark.parametrize("cls", [ShiftedWindowAttention, ShiftedWindowAttentionV2])
@pytest.mark.parametrize("shift", [[0, 0], [2, 2], [0, 2], [1, 3]])
@pytest.mark.parametrize("size", [(8, 8), (7, 9), (3, 5)])
@pytest.mark.parametrize("training", [False, True])
def test_every_head_kept_computes_what_torchvision_computes(cls, shift, size, training):
    """Bitwise the same outputs and parameter gradients as torchvision's layer (a map
    smaller than a window is not shifted along that side; 7 x 9 is padded)."""
    torch.manual_seed(0)
    layer = cls(16, [4, 4], shift, 4).train(training)
    check_given_class(layer, torch.randn(2, *size, 16, requires_grad=True))


def check_given_class(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """`layer` computes bitwise the same output and gradients (of its input and
    parameters) once given the class export gives it."""
    torch.manual_seed(1)  # the same dropout draws
    want = layer(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    layer.__class__ = PRUNED_CLASSES[type(layer)]
    torch.manual_seed(1)
    got = layer(x)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_heads_of_another_size_than_the_width_over_their_count():
    """Three heads of 4 in a layer of width 16 (torchvision's code cannot run it) compute
    what the four-head layer computes with the fourth head's output columns zeroed."""
    torch.manual_seed(0)
    layer = ShiftedWindowAttention(16, [2, 2], [1, 1], 4).eval()
    x = torch.randn(2, 6, 6, 16)
    with torch.no_grad():
        layer.proj.weight[:, 12:] = 0
        want = layer(x)
        rows = torch.arange(48) % 16 < 12  # the first three heads of the query, key, value
        layer.qkv.weight = torch.nn.Parameter(layer.qkv.weight[rows])
        layer.qkv.bias = torch.nn.Parameter(layer.qkv.bias[rows])
        layer.proj.weight = torch.nn.Parameter(layer.proj.weight[:, :12])
        table = layer.relative_position_bias_table
        layer.relative_position_bias_table = torch.nn.Parameter(table[:, :3])
        layer.num_heads = 3
        with pytest.raises(RuntimeError):  # torchvision's: a head size of 16 // 3
            layer(x)
        torch.testing.assert_close(window_attention(x, layer), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("training", [False, True])
def test_maxvit_attention_with_every_head_kept_computes_what_torchvision_computes(training):
    from torchvision.models.maxvit import RelativePositionalMultiHeadAttention

    torch.manual_seed(0)
    layer = RelativePositionalMultiHeadAttention(32, 8, 16).train(training)
    x = torch.randn(2, 3, 16, 32, requires_grad=True)
    want = layer(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    PRUNED_CLASSES[type(layer)].from_dense(layer)
    got = layer(x)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_maxvit_prunes_its_heads_with_a_float_and_exports_equal():
    """MaxViT's block and grid attention layers lose heads (their bias tables with them)
    with its convs and MLPs; the export computes what the hard-masked model does."""
    from torchvision.models.maxvit import MaxVit

    from dtp_kernels.pruning.heads import HeadGroup
    from dtp_kernels.pruning.torchvision_attention import PrunedMaxVitAttention

    torch.manual_seed(0)
    model = MaxVit(
        input_size=(32, 32),
        stem_channels=8,
        partition_size=2,
        block_channels=[16, 32],
        block_layers=[1, 1],
        head_dim=8,
        stochastic_depth_prob=0.0,
        num_classes=5,
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    assert [g.units for g in pruner.groups if isinstance(g, HeadGroup)] == [2, 2, 4, 4]
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    exported = pruner.export().eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
    layers = [m for m in exported.modules() if isinstance(m, PrunedMaxVitAttention)]
    assert [(m.n_heads, m.relative_position_bias_table.shape[1]) for m in layers] == [
        (1, 1),
        (1, 1),
        (2, 2),
        (2, 2),
    ]


def test_an_exported_swin_compiles_whole():
    """torch.compile takes an exported Swin with its pruned window attention in one graph
    (fullgraph: the roll, the padding and the region mask trace) and computes what it
    computes eagerly."""
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer([4, 4], 16, [2], [4], [2, 2], num_classes=5).eval()
    x = torch.randn(2, 3, 20, 20)  # 5 x 5 patches: padded to whole windows
    exported = DTPPruner(model, (x[:1],), 0.5).export().eval()
    compiled = torch.compile(exported, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), exported(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shift", [[0, 0, 0], [1, 1, 1], [0, 1, 1]])
@pytest.mark.parametrize("size", [(4, 4, 4), (3, 5, 6), (1, 4, 4)])
@pytest.mark.parametrize("training", [False, True])
def test_video_swin_attention_with_every_head_kept_computes_what_torchvision_computes(
    shift, size, training
):
    """Bitwise the same outputs and parameter gradients as torchvision's 3-D window
    attention (3 x 5 x 6 is padded to whole windows; one frame is not shifted in time)."""
    from torchvision.models.video.swin_transformer import ShiftedWindowAttention3d

    torch.manual_seed(0)
    layer = ShiftedWindowAttention3d(16, [2, 2, 2], shift, 4).train(training)
    check_given_class(layer, torch.randn(2, *size, 16, requires_grad=True))


def test_video_swin_prunes_its_heads_and_mlps_with_a_float():
    """Video Swin's heads (exported as PrunedShiftedWindowAttention3d) and MLP neurons
    (channels last in 5-D maps, flattened into each linear layer's matmul) prune with a
    float; the export equals the hard-masked model."""
    from torchvision.models.video.swin_transformer import SwinTransformer3d

    from dtp_kernels.pruning.torchvision_attention import PrunedShiftedWindowAttention3d

    torch.manual_seed(0)
    model = SwinTransformer3d(
        patch_size=[2, 4, 4],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=[2, 2, 2],
        num_classes=5,
    ).eval()
    x = torch.randn(2, 3, 4, 16, 16)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    assert [g.name for g in pruner.groups] == [
        f"features.{stage}.{block}.{part}"
        for stage in (0, 2)
        for block in (0, 1)
        for part in ("attn", "mlp.0")
    ]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
        with pruner.hard_masked():
            want = model(x)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
    layers = [m for m in exported.modules() if isinstance(m, PrunedShiftedWindowAttention3d)]
    assert [m.num_heads for m in layers] == [1, 1, 2, 2]


@pytest.mark.parametrize("version", [1, 2])
def test_mvit_prunes_its_heads_and_mlps_with_a_float(version):
    """torchvision's MViT (v1: a class token pooled with the keys; v2: residual pooling,
    relative positions, the projection after the attention widening the blocks): its
    fused `qkv` and `project` are the fused form, its heads' output reshaped to
    `output_dim`, which export writes with the kept width; the pooling convs, shared by
    all heads over their head size, stay whole, their FLOPs counted with the kept heads.
    The export equals the hard-masked model."""
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    from utils import check_export, randomised

    def block(heads, width_in, width_out, kernel_q, stride_q, stride_kv):
        return MSBlockConfig(
            num_heads=heads,
            input_channels=width_in,
            output_channels=width_out,
            kernel_q=kernel_q,
            kernel_kv=[3, 3, 3],
            stride_q=stride_q,
            stride_kv=stride_kv,
        )

    blocks = [
        block(2, 16, 16, [], [], [1, 2, 2]),
        block(2, 16, 32, [3, 3, 3], [1, 2, 2], [1, 1, 1]),
        block(4, 32, 32, [], [], [1, 1, 1]),
    ]
    torch.manual_seed(0)
    v2 = version == 2
    model = MViT(
        spatial_size=(32, 32),
        temporal_size=4,
        block_setting=blocks,
        residual_pool=v2,
        residual_with_cls_embed=not v2,
        rel_pos_embed=v2,
        proj_after_attn=v2,
        num_classes=5,
    ).eval()
    x = torch.randn(2, 3, 4, 32, 32)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    heads = [(g.name, g.size) for g in pruner.groups if g.name.endswith("attn")]
    assert heads == [("blocks.0.attn", 2), ("blocks.1.attn", 2), ("blocks.2.attn", 4)]
    exported = check_export(pruner, model, x)  # the pooling convs' FLOPs with the heads
    layers = [exported.blocks[i].attn for i in range(3)]
    assert [(m.num_heads, m.output_dim) for m in layers] == [(1, 8), (1, 8 * (1 + v2)), (2, 16)]
    pruner.remove()
    budgeted = DTPPruner(model, (x[:1],), 0.5, budget="flops")  # F(alpha) at alpha = k/n
    report = budgeted.report()
    torch.testing.assert_close(
        budgeted.flops_ratio().item(), report["flops_after"] / report["flops_before"]
    )
