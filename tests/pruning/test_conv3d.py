"""3-D convolutions (video and volumes) prune as 2-D ones do: torchvision's video networks
(R3D, MC3, R(2+1)D, S3D), a 3-D U-Net (skip concatenations, a transposed convolution,
instance norms), an X3D-style block (depthwise 3-D convolution, squeeze-and-excitation,
a residual add), a grouped 3-D convolution and a 3-D channel shuffle (the layers before
it left whole): the groups found, exact kept counts,
the export equal to the hard-masked model with the report's parameters and FLOPs; and
single weights and N:M blocks of a Conv3d, every block keeping exactly N."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.precision import ieee_fp32
from utils import check_export, drawn_statistics, randomised

torchvision = pytest.importorskip("torchvision")


def video_clip() -> torch.Tensor:
    """Two clips of 4 frames of 32 x 32."""
    return torch.randn(2, 3, 4, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("name", "groups"), [("r3d_18", 8), ("mc3_18", 8), ("r2plus1d_18", 25), ("s3d", 77)]
)
def test_torchvision_video_networks(name, groups):
    """A block's inner channels (R(2+1)D's between its spatial and temporal convs too;
    S3D's separable Inception branches); the widths residual adds join stay whole."""
    torch.manual_seed(0)
    model = getattr(torchvision.models.video, name)(num_classes=5)
    model = drawn_statistics(model).eval()
    # S3D pools its last maps with a (2, 7, 7) kernel: 16 frames of 224 x 224 at least
    x = torch.randn(1, 3, 16, 224, 224) if name == "s3d" else video_clip()
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert len(pruner.groups) == groups
    assert all(isinstance(g.layer, nn.Conv3d) for g in pruner.groups)
    assert pruner.kept == [g.size // 2 for g in pruner.groups]
    exported = check_export(pruner, model, x)
    modules = dict(exported.named_modules())
    assert [modules[g.name].out_channels for g in pruner.groups] == pruner.kept


class UNet3d(nn.Module):
    """Two levels of a 3-D U-Net: conv-norm-ReLU pairs, max pooling, a transposed
    convolution up and the skip concatenated, a 1x1x1 output conv."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()

        def pair(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv3d(c_in, c_out, 3, padding=1),
                norm(c_out, affine=True),
                nn.ReLU(),
                nn.Conv3d(c_out, c_out, 3, padding=1),
                norm(c_out, affine=True),
                nn.ReLU(),
            )

        self.down, self.bottom = pair(1, 8), pair(8, 16)
        self.up = nn.ConvTranspose3d(16, 8, 2, stride=2)
        self.decode = pair(16, 8)
        self.out = nn.Conv3d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down(x)
        bottom = self.bottom(nn.functional.max_pool3d(skip, 2))
        return self.out(self.decode(torch.cat([self.up(bottom), skip], dim=1)))


@pytest.mark.parametrize("norm", [nn.BatchNorm3d, nn.InstanceNorm3d])
def test_a_3d_unet(norm):
    torch.manual_seed(0)
    model = drawn_statistics(UNet3d(norm)).eval()
    for module in model.modules():  # instance norms' affine parameters away from 1 and 0
        if isinstance(module, nn.InstanceNorm3d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.uniform_(module.bias, -0.2, 0.2)
    x = torch.randn(2, 1, 8, 8, 8)
    # a batch of two: an instance norm folds it into the channels and back
    pruner = randomised(DTPPruner(model, (x,), 0.5))
    names = [g.name for g in pruner.groups]
    # the first conv of each pair; the second's channels are concatenated (the skip) or
    # read by the transposed conv and by the output conv
    assert {"down.0", "bottom.0", "decode.0"} <= set(names)
    check_export(pruner, model, x, example=(x,))
    assert pruner.report()["flops_after"] < pruner.report()["flops_before"]


def test_a_c3d_classifier():
    """Plain 3-D convs, pooled and flattened into a linear layer: the last conv's
    channels reach the classifier through the flatten of (N, C, 1, 1, 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1),
        nn.BatchNorm3d(8),
        nn.ReLU(),
        nn.MaxPool3d(2),
        nn.Conv3d(8, 16, 3, padding=1),
        nn.BatchNorm3d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(16, 5),
    )
    model = drawn_statistics(model).eval()
    x = torch.randn(2, 3, 4, 8, 8)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [g.name for g in pruner.groups] == ["0", "4"]
    exported = check_export(pruner, model, x)
    assert exported[9].in_features == 8


class X3dBlock(nn.Module):
    """X3D's bottleneck: 1x1x1 expansion, a depthwise 3x3x3 conv, squeeze-and-excitation,
    a 1x1x1 projection, the input added."""

    def __init__(self, width: int = 8, inner: int = 24) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv3d(width, inner, 1, bias=False), nn.BatchNorm3d(inner))
        self.depthwise = nn.Sequential(
            nn.Conv3d(inner, inner, 3, padding=1, groups=inner, bias=False), nn.BatchNorm3d(inner)
        )
        self.squeeze = nn.Conv3d(inner, 8, 1)
        self.excite = nn.Conv3d(8, inner, 1)
        self.project = nn.Sequential(nn.Conv3d(inner, width, 1, bias=False), nn.BatchNorm3d(width))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.relu(self.expand(x))
        h = self.depthwise(h)
        scale = self.excite(nn.functional.relu(self.squeeze(h.mean((2, 3, 4), keepdim=True))))
        h = nn.functional.silu(h * scale.sigmoid())
        out = nn.functional.relu(x + self.project(h))
        return self.head(out.mean((2, 3, 4)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_an_x3d_block(device):
    """The expansion's channels, through the depthwise conv and the excitation, are one
    group; the squeeze's hidden width another; on the model's device."""
    torch.manual_seed(0)
    model = drawn_statistics(X3dBlock()).eval()
    nn.init.normal_(model.project[0].weight, std=0.5)  # the block's part of the output shows
    model.to(device)
    x = torch.randn(2, 8, 4, 6, 6, device=device)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [(g.name, g.size) for g in pruner.groups] == [("expand.0", 24), ("squeeze", 8)]
    with ieee_fp32():  # TF32 convolutions would round the two models apart
        exported = check_export(pruner, model, x)
    assert exported.depthwise[0].groups == exported.depthwise[0].out_channels == 12
    assert exported.expand[0].weight.device.type == device


def test_a_grouped_3d_conv_keeps_equal_parts():
    """A ResNeXt-style grouped conv splits its input channels into equal parts, each
    keeping as many."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv3d(3, 16, 1),
        nn.BatchNorm3d(16),
        nn.ReLU(),
        nn.Conv3d(16, 16, 3, padding=1, groups=4),
        nn.BatchNorm3d(16),
        nn.ReLU(),
        nn.Conv3d(16, 4, 1),
    )
    model = drawn_statistics(model).eval()
    x = torch.randn(2, 3, 4, 6, 6)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [g.name for g in pruner.groups] == ["0", "3"]
    exported = check_export(pruner, model, x)
    assert (exported[3].in_channels, exported[3].out_channels, exported[3].groups) == (8, 8, 4)


def test_single_weights_and_nm_blocks_of_a_conv3d():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv3d(16, 4, 1))
    x = torch.randn(2, 8, 4, 6, 6)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.75, granularity="weight"))
    masks = pruner.hard_masks()
    assert [int(m.sum()) for m in masks] == [16 * 8 * 27 // 4, 4 * 16 // 4]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export()
    assert int((exported[0].weight != 0).sum()) == 16 * 8 * 27 // 4
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-6)
    pruner.remove()
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5, granularity="n:m", nm=(2, 4)))
    exported = pruner.export()
    for layer in (exported[0], exported[2]):
        blocks = (layer.weight.detach().movedim(1, -1).reshape(-1, 4) != 0).sum(1)
        assert torch.equal(blocks, torch.full_like(blocks, 2))


class Shuffled3d(nn.Module):
    """A grouped 3-D conv whose input channels a shuffle interleaves (ShuffleNet's, in
    3-D): a view to (N, groups, C / groups, D, H, W), a transpose, a view back."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Conv3d(3, 8, 1), nn.BatchNorm3d(8), nn.ReLU())
        self.grouped = nn.Sequential(
            nn.Conv3d(8, 8, 3, padding=1, groups=2), nn.BatchNorm3d(8), nn.ReLU()
        )
        self.out = nn.Conv3d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        n, c, *rest = h.shape
        h = h.view(n, 2, c // 2, *rest).transpose(1, 2).reshape(n, c, *rest)
        return self.out(self.grouped(h))


def test_a_3d_channel_shuffle_leaves_the_layers_before_it_whole():
    """The shuffle permutes the channels, which the graph cannot map: the first conv's
    channels stay whole; the grouped conv's prune."""
    torch.manual_seed(0)
    model = drawn_statistics(Shuffled3d()).eval()
    x = torch.randn(2, 3, 4, 6, 6)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [g.name for g in pruner.groups] == ["grouped.0"]
    check_export(pruner, model, x)
