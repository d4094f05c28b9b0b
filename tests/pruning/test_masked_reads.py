"""The proof that a group's readers read zero where its mask is zero (masked_reads.py):
what it lets through (a concatenation's other parts, a product) and what it leaves
whole (a constant added after the mask). ShuffleNetV2's and MaxViT's stems, read before
their mask, are in test_channel_shuffle.py and test_excitations.py; the channel mean
subtracted after the mask in test_pruner.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import squeezenet1_1

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_params
from utils import check_export, drawn_statistics, randomised


def test_a_branch_concatenated_with_others_is_a_group_and_exports_equal():
    """SqueezeNet's fire modules concatenate an expand 1x1 and an expand 3x3 branch, and
    the next squeeze conv reads both: each branch's channels are zero where its mask is,
    whatever the other part holds. Every conv but the classifier is a group."""
    torch.manual_seed(0)
    model, x = squeezenet1_1(num_classes=5).eval(), torch.randn(2, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert [g.name for g in pruner.groups] == convs[:-1]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]


class ShiftedAfterMask(nn.Module):
    """conv, BN, then a constant added (a masked channel reads 1, not 0), a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.b, self.bn_b = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.a(x)) + 1)
        return self.head(torch.relu(self.bn_b(self.b(x)))).mean((2, 3))


def test_a_constant_added_after_the_mask_moves_the_mask_to_the_readers_columns():
    """A masked channel would read 1 after the shift: the group's readers are all convs
    that read exactly its channels, so the mask goes on their input columns instead of
    the BN, and the export still equals the hard-masked model."""
    torch.manual_seed(0)
    model, x = drawn_statistics(ShiftedAfterMask()).eval(), torch.randn(2, 3, 8, 8)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    shifted, plain = pruner.groups
    assert (shifted.name, plain.name) == ("a", "b")
    assert shifted.gated and shifted.bn is None and shifted.kept_in == [model.b]
    assert not plain.gated and plain.bn is model.bn_b
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert exported.b.in_channels == pruner.kept[0]


# the readers ShiftedThenRead ends in, by form
SHIFTED_READERS = {
    "centered": lambda: nn.Conv2d(8, 5, 1),
    "grouped": lambda: nn.Conv2d(8, 4, 1, groups=2),
    "wider": lambda: nn.Conv2d(11, 5, 1),
    "flatten": lambda: nn.Linear(8 * 8 * 8, 5),
}


class ShiftedThenRead(nn.Module):
    """conv, BN, a constant added, then a reader whose input columns cannot take the
    mask, by `form`: "centered", the channel mean subtracted first (each channel then
    reads every other); "grouped", a grouped conv; "wider", a conv over the channels
    concatenated with the input; "flatten", a linear layer over the flattened map (each
    channel read at every position)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.a, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = SHIFTED_READERS[form]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.a(x)) + 1)
        if self.form == "flatten":
            return self.head(y.flatten(1))
        if self.form == "centered":
            y = y - y.mean(1, keepdim=True)
        elif self.form == "wider":
            y = torch.cat([y, x], 1)
        return self.head(y).mean((2, 3))


class MixedBeforeReader(nn.Module):
    """A linear layer, ReLU, a matmul with a fixed mixing matrix over the features and a
    view back to the tokens, a linear layer: the matmul before the reader is not its
    own (each output feature reads every input one)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 5)
        self.register_buffer("mix", torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)  # (batch, 64 tokens, 3)
        h = torch.relu(self.a(torch.cat([tokens, tokens[..., :1].repeat(1, 1, 5)], -1)))
        return self.head((h.reshape(-1, 8) @ self.mix).reshape(h.shape)).mean(1)


@pytest.mark.parametrize(
    "build",
    [
        *[lambda form=form: ShiftedThenRead(form) for form in SHIFTED_READERS],
        MixedBeforeReader,
    ],
    ids=[*SHIFTED_READERS, "mixed"],
)
def test_unmasked_readers_whose_columns_cannot_take_the_mask_leave_the_group_whole(build):
    model, x = build().eval(), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="prune nothing"):
        DTPPruner(model, (x,), 0.5)


class PReLUAfterMask(nn.Module):
    """conv, BN, PReLU (a module of two inputs to the graph: the channels and its
    weight), a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.PReLU(8)
        self.head = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.bn(self.a(x)))).mean((2, 3))


def test_a_prelu_after_the_mask_keeps_zero_and_is_cut_with_the_channels():
    torch.manual_seed(0)
    model, x = PReLUAfterMask().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        model.act.weight.uniform_(0.1, 0.5)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [g.name for g in pruner.groups] == ["a"]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert exported.act.weight.shape == (4,)


def test_channels_through_a_depthwise_conv_without_bias_and_no_bn_after_it_prune():
    """Xception's separable convs: BN, ReLU, then a depthwise conv with no bias and no BN
    after it, read by the pointwise conv. The mask sits at the BN; a depthwise conv of
    zeros is zeros, so the pointwise conv reads zero where it is zero. timm's Xception
    had 2 groups before (1.05x fewer FLOPs at 0.5); every separable conv's channels but
    those a residual adds are now a group."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = drawn_statistics(timm.create_model("legacy_xception", num_classes=5)).eval()
    nn.init.normal_(model.fc.weight, std=0.1)
    x = torch.randn(2, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    names = [g.name for g in pruner.groups]
    assert "block2.rep.1.pointwise" in names and len(names) == 24
    check_export(pruner, model, x)
    report = pruner.report()
    assert report["flops_before"] / report["flops_after"] > 2


def test_a_depthwise_conv_with_a_bias_after_the_mask_leaves_its_group_whole_or_masks_it():
    """A depthwise conv whose bias would come back on the masked channels is where the
    mask goes (its rows), so the group still exports equal; a bias is never taken as zero."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=True),
        nn.Conv2d(8, 4, 1),
    ).eval()
    drawn_statistics(model)
    x = torch.randn(2, 3, 16, 16)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    (group,) = pruner.groups
    assert group.rows is model[3] and group.bn is None
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(pruner.export().eval()(x), want, rtol=1e-5, atol=1e-5)


def test_poolformers_mlps_through_star_relu_are_masked_on_their_readers_columns():
    """timm's PoolFormerV2 (MetaFormer): each MLP's hidden channels pass StarReLU,
    s * relu(x)^2 + b, so a masked channel reads b. Its one reader, fc2, takes the mask
    on its columns; the norms without a bias (GroupNorm1NoBias) count one parameter per
    channel. Before, a float found no group in it."""
    pytest.importorskip("timm")
    from timm.models.metaformer import GroupNorm1NoBias, MetaFormer, StarReLU

    torch.manual_seed(0)
    model = MetaFormer(
        depths=(1, 1),
        dims=(16, 32),
        norm_layers=GroupNorm1NoBias,
        use_mlp_head=False,
        num_classes=5,
        mlp_act=StarReLU,
    ).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, StarReLU):
                module.bias.fill_(0.5)
    x = torch.randn(2, 3, 32, 32)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    mlps = {g.name: g for g in pruner.groups if ".mlp.fc1" in g.name}
    assert set(mlps) == {"stages.0.blocks.0.mlp.fc1", "stages.1.blocks.0.mlp.fc1"}
    assert all(g.gated for g in mlps.values())
    assert count_params(model) == pruner.predicted_counts([torch.ones(n) for n in pruner.sizes])[0]
    check_export(pruner, model, x)


def test_pvt_v2s_mlps_read_through_the_view_after_their_second_layers_matmul():
    """timm's PVTv2: fc1, a depthwise conv over the tokens laid out as an image, GELU,
    fc2. fc2 reads a transposed (non-contiguous) input, so torch computes it as a matmul,
    a view back to the tokens, then the bias: the proof walks through that view to the
    matmul on fc2's own weight. Before, no MLP of it was a group."""
    pytest.importorskip("timm")
    from timm.models.pvt_v2 import PyramidVisionTransformerV2

    torch.manual_seed(0)
    model = PyramidVisionTransformerV2(
        depths=(1, 1),
        embed_dims=(16, 32),
        num_heads=(1, 2),
        sr_ratios=(2, 1),
        mlp_ratios=(4, 4),
        num_classes=5,
    ).eval()
    nn.init.normal_(model.head.weight, std=0.1)
    x = torch.randn(2, 3, 32, 32)
    pruner = randomised(DTPPruner(model, (x[:1],), {"mlp": 0.5}))
    assert [g.name for g in pruner.groups] == [
        "stages.0.blocks.0.mlp.fc1",
        "stages.1.blocks.0.mlp.fc1",
    ]
    check_export(pruner, model, x)


class ScalarActivation(nn.Module):
    """a * x^2 + b * x + c with learned one-element a, b, c: the same for every channel,
    and c (softplus'd, as XIELU does) where a channel is zero."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.full((1,), v)) for v in (0.3, 0.5, 0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a * x * x + self.b * x + nn.functional.softplus(self.c)


class ScalarActivationMLP(nn.Module):
    """Tokens through up (no bias), the activation above, down (no bias): torch computes
    each layer on the 3-D tokens as a matmul of its own weight."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act = nn.Linear(8, 16, bias=False), ScalarActivation()
        self.down, self.head = nn.Linear(16, 8, bias=False), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.act(self.up(x))).mean(1))


def test_an_activation_of_learned_scalars_moves_the_mask_to_the_readers_columns():
    """The additions inside the activation join terms of one channel and scalars, no
    other layer's channels, and the matmul before `down` is its own: the group's one
    reader takes the mask on its columns."""
    torch.manual_seed(0)
    model, x = ScalarActivationMLP().eval(), torch.randn(2, 6, 8)
    pruner = randomised(DTPPruner(model, (x[:1],), {"up": 0.5}))
    (group,) = pruner.groups
    assert group.name == "up" and group.gated and group.kept_in == [model.down]
    check_export(pruner, model, x)


def test_apertus_mlps_through_xielu_are_masked_on_down_proj_columns():
    """Apertus's MLP is up_proj, XIELU, down_proj; XIELU's learned scalars and its
    epsilon make it nonzero at zero. Before, no MLP of it was a group."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ApertusConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.ApertusForCausalLM(config).eval()
    assert model.model.layers[0].mlp.act_fn(torch.zeros(1)).item() != 0
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    pruner = randomised(DTPPruner(model, (x[:1],), {"mlp": 0.5}))
    mlps = [layer.mlp for layer in model.model.layers]
    assert [(g.layer, g.kept_in, g.gated) for g in pruner.groups] == [
        (mlp.up_proj, [mlp.down_proj], True) for mlp in mlps
    ]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x).logits
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, want, rtol=1e-5, atol=1e-5)
    assert [layer.mlp.down_proj.in_features for layer in exported.model.layers] == [32, 32]
    assert exported.config.intermediate_size == 32


class PerChannelActivation(nn.Module):
    """x^2 times or plus a learned vector of one entry per channel (`form`: "scaled" or
    "shifted"): a raw parameter cut with the channels."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.c = form, nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x * self.c if self.form == "scaled" else x * x + self.c


@pytest.mark.parametrize("form", ["scaled", "shifted"])
def test_a_per_channel_parameter_after_the_mask_keeps_the_group_only_when_it_scales(form):
    """Scaled, a removed channel still reads zero: the group prunes, its vector cut with
    it, and exports equal. Shifted, it would read c: the group is left whole (before, it
    was a group whose export failed its check)."""
    torch.manual_seed(0)
    model, x = ScalarActivationMLP().eval(), torch.randn(2, 6, 8)
    model.act = PerChannelActivation(form)
    if form == "shifted":
        with pytest.raises(ValueError, match=r"ratios names \['up'\], which match no"):
            DTPPruner(model, (x[:1],), {"up": 0.5})
        return
    pruner = randomised(DTPPruner(model, (x[:1],), {"up": 0.5}))
    (group,) = pruner.groups
    assert not group.gated and group.scales == [(model.act, "c", 0)]
    exported = check_export(pruner, model, x)
    assert exported.act.c.shape == (8,)
