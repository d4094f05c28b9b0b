"""Fixed per-channel filters (fixed_filters.py): timm's BlurPool2d (TResNet, the
anti-aliased ResNets) and antialiased-cnns' Downsample convolve each channel with a
buffer of one filter per channel. The groups whose channels pass one prune, the buffer
is cut with the channels, and the export equals the hard-masked model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.fixed_filters import is_fixed_filter
from utils import check_export, drawn_statistics, randomised

timm = pytest.importorskip("timm")


class Downsample(nn.Module):
    """antialiased-cnns' form: a binomial filter per channel in a buffer, the `groups`
    its convolution takes read from the input, no `channels` held."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        row = torch.tensor([1.0, 2.0, 1.0])
        filt = (row[:, None] * row[None, :]) / 16
        self.register_buffer("filt", filt[None, None].repeat(channels, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.conv2d(
            functional.pad(x, (1, 1, 1, 1), mode="reflect"), self.filt, stride=2, groups=x.shape[1]
        )


class BlurredNet(nn.Module):
    """conv, BN, ReLU, a blur that downsamples, conv, BN, ReLU, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.blur = Downsample(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blur(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))


def timm_blurred_resnet() -> nn.Module:
    from timm.layers import BlurPool2d
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(
        BasicBlock, [1, 1, 1, 1], num_classes=5, channels=(16, 32, 32, 64), aa_layer=BlurPool2d
    )


def timm_tresnet() -> nn.Module:
    from timm.models.tresnet import TResNet

    return TResNet([1, 1, 1, 1], num_classes=5, width_factor=0.25)


MODELS = {
    "antialiased_downsample": (BlurredNet, ["conv1"]),
    "timm_blurred_resnet": (
        timm_blurred_resnet,
        ["conv1", "layer2.0.conv1", "layer3.0.conv1", "layer4.0.conv1"],
    ),
    "timm_tresnet": (
        timm_tresnet,
        ["body.layer2.0.conv1.conv", "body.layer3.0.conv2.conv", "body.layer4.0.conv2.conv"],
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_channels_through_a_fixed_filter_prune_and_export_equal(name):
    build, blurred = MODELS[name]
    torch.manual_seed(0)
    model = drawn_statistics(build()).eval()
    for module in model.modules():  # the classifier: timm starts TResNet's at zero
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.1)
    filters = {n: m for n, m in model.named_modules() if is_fixed_filter(m)}
    assert filters
    x = torch.randn(2, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    kept = {g.name: k for g, k in zip(pruner.groups, pruner.kept, strict=True)}
    assert set(blurred) <= set(kept)  # the group each filter (in model order) carries
    exported = check_export(pruner, model, x, atol=1e-5)
    cut = dict(exported.named_modules())
    assert [cut[n].filt.shape[0] for n in filters] == [kept[n] for n in blurred]
    for n in filters:
        if isinstance(getattr(cut[n], "channels", None), int):  # timm's: the groups it passes
            assert cut[n].channels == cut[n].filt.shape[0]


def test_a_module_is_a_fixed_filter_only_with_one_per_channel_buffer_and_no_parameters():
    from timm.layers import BlurPool2d

    assert is_fixed_filter(BlurPool2d(8)) and is_fixed_filter(Downsample(8))
    assert not is_fixed_filter(BlurPool2d(None))  # one filter for every channel: nothing to cut
    assert not is_fixed_filter(nn.Conv2d(8, 8, 3, groups=8))  # its weight is a parameter
    assert not is_fixed_filter(nn.BatchNorm2d(8))


@pytest.mark.parametrize(
    ("name", "size", "speedup"), [("tresnet_m", 224, 2.39), ("legacy_xception", 299, 2.26)]
)
def test_the_speedups_docs_pruning_quotes(name, size, speedup):
    """docs/pruning.md's figures: timm's TResNet-M and Xception at a float 0.5."""
    model = timm.create_model(name, num_classes=1000).eval()
    report = DTPPruner(model, (torch.randn(1, 3, size, size),), 0.5).report()
    assert round(report["flops_before"] / report["flops_after"], 2) == speedup
