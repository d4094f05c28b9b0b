"""Channels scaled by their own squeeze-and-excitation block (EfficientNet, MobileNetV3,
RegNetY; torchvision's and timm's): one group with the excitation's second layer, the
export equal to the hard-masked model; where a reader of the channels would not read
zero under the mask, the group is left whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from utils import check_export, drawn_statistics, randomised, small_regnet_y


def torchvision_efficientnet() -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    settings = [MBConvConfig(1, 3, 1, 16, 8, 1), MBConvConfig(4, 3, 2, 8, 16, 2)]
    return EfficientNet(settings, dropout=0.0, num_classes=5, last_channel=32)


def torchvision_mobilenet_v3() -> nn.Module:
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

    settings = [
        InvertedResidualConfig(16, 3, 32, 16, True, "RE", 2, 1, 1.0),
        InvertedResidualConfig(16, 5, 48, 24, True, "HS", 2, 1, 1.0),
    ]
    return MobileNetV3(settings, last_channel=32, num_classes=5)


def timm_efficientnet() -> nn.Module:
    import timm

    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=5)


def timm_mobilenet_v3() -> nn.Module:
    import timm

    return timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=5)


def torchvision_maxvit() -> nn.Module:
    from torchvision.models.maxvit import MaxVit

    return MaxVit(
        input_size=(64, 64),
        stem_channels=16,
        partition_size=2,
        block_channels=[16, 32],
        block_layers=[1, 1],
        head_dim=8,
        stochastic_depth_prob=0.0,
        num_classes=5,
    )


MODELS = {
    "torchvision_efficientnet": torchvision_efficientnet,
    "torchvision_mobilenet_v3": torchvision_mobilenet_v3,
    "torchvision_regnet_y": small_regnet_y,
    "timm_efficientnet": timm_efficientnet,
    "timm_mobilenet_v3": timm_mobilenet_v3,
    "torchvision_maxvit": torchvision_maxvit,
}


def excitations(model: nn.Module) -> list[nn.Module]:
    """The second layer of every squeeze-and-excitation block: torchvision's `fc2`,
    timm's `conv_expand`."""
    return [
        getattr(m, name)
        for m in model.modules()
        for name in ("fc2", "conv_expand")
        if "excit" in type(m).__name__.lower() and hasattr(m, name)
    ]


@pytest.mark.parametrize("name", list(MODELS))
def test_channels_scaled_by_their_excitation_prune_and_export_equal(name):
    torch.manual_seed(0)
    model = drawn_statistics(MODELS[name]()).eval()
    x = torch.randn(2, 3, 64, 64)
    expanders = excitations(model)
    assert expanders
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    excited = [g for g in pruner.groups if set(g.kept_out) & set(expanders)]
    # every excitation scales a pruned group, whose root makes the channels
    assert {e for g in excited for e in g.kept_out if e in expanders} == set(expanders)
    assert all(g.layer not in expanders for g in excited)
    exported = check_export(pruner, model, x)
    names = dict(exported.named_modules())
    for group, kept in zip(pruner.groups, pruner.kept, strict=True):
        for expander in set(group.kept_out) & set(expanders):
            cut = names[next(n for n, m in model.named_modules() if m is expander)]
            assert cut.out_channels == kept


class ScaledBlock(nn.Module):
    """conv, BN, activation, an excitation of the channels, and a reader; `form` varies
    where the excitation reads and how it scales."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.dw_bn = nn.BatchNorm2d(8)
        self.fc1, self.fc2 = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.head = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        early = torch.relu(self.bn(self.conv(x)))
        y = self.dw_bn(self.dw(early))
        # the excitation reads the channels before the mask (at dw_bn) in "early"
        squeezed = (early if self.form == "early" else y).mean((2, 3), keepdim=True)
        scale = torch.sigmoid(self.fc2(torch.relu(self.fc1(squeezed))))
        # a sigmoid of the masked channels is 1/2, not 0
        y = torch.sigmoid(y) if self.form == "sigmoid" else torch.relu(y)
        y = y + scale if self.form == "added" else y * scale
        return self.head(y).mean((2, 3))


@pytest.mark.parametrize("form", ["early", "sigmoid", "added"])
def test_channels_a_reader_sees_unmasked_are_left_whole(form):
    """Where the excitation reads before the mask, the masked channels pass a sigmoid,
    or the scale is added: removing a channel would not compute what masking it does,
    so the group is left whole (only the excitation's own hidden width prunes)."""
    torch.manual_seed(0)
    model = drawn_statistics(ScaledBlock(form)).eval()
    x = torch.randn(2, 3, 8, 8)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [g.name for g in pruner.groups] == ["fc1"]
    pruner.export()


def test_the_plain_block_prunes_its_channels():
    torch.manual_seed(0)
    model = drawn_statistics(ScaledBlock("plain")).eval()
    x = torch.randn(2, 3, 8, 8)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [g.name for g in pruner.groups] == ["conv", "fc1"]
    assert pruner.groups[0].bn is model.dw_bn and model.fc2 in pruner.groups[0].kept_out
    check_export(pruner, model, x)


@pytest.mark.parametrize("name,speedup", [("efficientnet_b0", 2.19), ("mobilenet_v3_large", 2.04)])
def test_the_speedups_docs_pruning_quotes(name, speedup):
    """docs/pruning.md: a float 0.5 on torchvision's EfficientNet-B0 and
    MobileNetV3-Large (64 x 64 images) reports these FLOPs speed-ups."""
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=10).eval()
    pruner = DTPPruner(model, (torch.randn(1, 3, 64, 64),), 0.5)
    assert round(pruner.report()["speedup"], 2) == speedup


def test_maxvits_stem_output_read_before_its_mask_is_masked_on_its_readers_columns():
    """MaxViT's second stem conv feeds the first block's BN (where its mask would go)
    and, before it, the block's pooled shortcut conv: a mask at the BN would not reach
    the shortcut, so that group's mask goes on both readers' input columns; the first
    stem conv, each MBConv's expansion and the MLPs prune as before."""
    torch.manual_seed(0)
    model = drawn_statistics(torchvision_maxvit()).eval()
    x = torch.randn(2, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    groups = {g.name: g for g in pruner.groups}
    block = "blocks.0.layers.0.layers"
    stem = groups["stem.1.0"]
    assert stem.gated and stem.bn is None
    layers = dict(model.named_modules())
    assert set(stem.kept_in) == {
        layers[f"{block}.MBconv.proj.1"],
        layers[f"{block}.MBconv.layers.conv_a.0"],
    }
    assert not groups["stem.0.0"].gated
    assert {f"{block}.MBconv.layers.conv_a.0", f"{block}.window_attention.mlp_layer.1"} <= set(
        groups
    )
    check_export(pruner, model, x)
