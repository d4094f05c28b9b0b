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
from utils import drawn_statistics, randomised


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


def test_a_constant_added_after_the_mask_leaves_the_group_whole():
    model, x = ShiftedAfterMask().eval(), torch.randn(1, 3, 8, 8)
    assert [g.name for g in DTPPruner(model, (x,), 0.5).groups] == ["b"]


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
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
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
