"""Channels through grouped convolutions (ResNeXt, RegNet; torchvision's and timm's):
each group of a grouped convolution keeps as many channels, the export equals the
hard-masked model, and a count the groups cannot keep alike is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, L1Pruner
from dtp_kernels.pruning.cost import count_flops, count_params
from dtp_kernels.pruning.grouped_convs import cut_grouped_inputs, is_grouped
from utils import drawn_statistics, randomised, small_regnet_y


def torchvision_resnext() -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=8, num_classes=5)


def timm_resnext() -> nn.Module:
    from timm.models.resnet import Bottleneck, ResNet

    return ResNet(
        Bottleneck, (1, 1, 1, 1), num_classes=5, cardinality=4, base_width=8, stem_width=16
    )


def timm_regnet_x() -> nn.Module:
    import timm

    return timm.create_model("regnetx_002", pretrained=False, num_classes=5)


class GroupedConv1d(nn.Module):
    """A 1-D stack whose middle convolution has 3 groups."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv1d(4, 12, 3, padding=1), nn.BatchNorm1d(12)
        self.b, self.bn_b = nn.Conv1d(12, 12, 3, padding=1, groups=3), nn.BatchNorm1d(12)
        self.head = nn.Conv1d(12, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_a(self.a(x)))
        return self.head(torch.relu(self.bn_b(self.b(x)))).mean(-1)


MODELS = {
    "torchvision_resnext": (torchvision_resnext, (2, 3, 32, 32)),
    "torchvision_regnet_y": (small_regnet_y, (2, 3, 32, 32)),
    "timm_resnext": (timm_resnext, (2, 3, 32, 32)),
    "timm_regnet_x": (timm_regnet_x, (2, 3, 32, 32)),
    "conv1d": (GroupedConv1d, (2, 4, 16)),
}


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    builder, shape = MODELS[name]
    return drawn_statistics(builder()).eval(), torch.randn(shape)


def grouped_groups(pruner) -> list:
    return [g for g in pruner.groups if g.segments > 1]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_group_of_a_grouped_conv_keeps_as_many_and_the_export_is_equal(name):
    model, x = build(name)
    grouped = {m: m.groups for m in model.modules() if is_grouped(m)}
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    segmented = grouped_groups(pruner)
    assert segmented, "no group passes a grouped conv"
    for group in segmented:  # its grouped convs' groups, each keeping k / G
        convs = [m for m in [*group.kept_out, *group.kept_in] if is_grouped(m)]
        assert {grouped[m] for m in convs} == {group.segments}
    masks = pruner.hard_masks()
    for group, mask, kept in zip(pruner.groups, masks, pruner.kept, strict=True):
        per_segment = mask.view(group.segments, -1).sum(1)
        assert per_segment.tolist() == [kept // group.segments] * group.segments
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
    assert count_flops(exported, (x[:1],))  # the example's == report["flops_after"]
    names = dict(exported.named_modules())
    for conv, groups in grouped.items():  # the same groups, each as wide as the others
        name_of = next(n for n, m in model.named_modules() if m is conv)
        cut = names[name_of]
        assert cut.groups == groups
        assert cut.weight.shape[:2] == (cut.out_channels, cut.in_channels // groups)
    assert any(
        names[n].in_channels < m.in_channels for n, m in model.named_modules() if m in grouped
    )


def test_a_grouped_input_cut_keeps_each_groups_own_channels():
    """The cut of a grouped conv's inputs keeps, in each group, that group's channels:
    a conv equal on the kept inputs to the dense conv with the others zeroed."""
    torch.manual_seed(0)
    conv = nn.Conv2d(12, 6, 3, groups=3, bias=False)
    keep = torch.tensor([1, 3, 4, 7, 8, 10])  # two of each group of four, not alike
    x = torch.randn(2, 12, 5, 5)
    zeroed = torch.zeros_like(x)
    zeroed[:, keep] = x[:, keep]
    want = conv(zeroed)
    cut_grouped_inputs(conv, conv.weight, keep)
    assert conv.in_channels == 6 and conv.weight.shape == (6, 2, 3, 3)
    torch.testing.assert_close(conv(x[:, keep]), want)


@pytest.mark.parametrize(
    "name,shape", [("torchvision_resnext", (4, 3, 64, 64)), ("conv1d", (4, 4, 16))]
)
def test_scores_get_the_gradient_of_the_other_backend_and_training_steps(name, shape):
    # feature maps of 2 x 2 and more: BN's batch statistics over a 1 x 1 map of two
    # images would magnify the backends' rounding differences
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for backend in ("torch", "cpu"):
        model, _ = build(name)
        pruner = DTPPruner(model, (x[:1],), 0.5, backend=backend)
        model.train()
        model(x).square().mean().backward()
        grads.append(pruner.scores.grad.clone())
    assert torch.count_nonzero(grads[1]) > 0.9 * grads[1].numel()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    target = torch.tensor([0, 3, 1, 4])
    optimizer = torch.optim.SGD([*model.parameters(), pruner.scores], lr=0.05, momentum=0.9)
    pruner.attach(optimizer)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), target).backward()
        optimizer.step()
    assert int(pruner.state.steps) == 3
    for group, mask in zip(pruner.groups, pruner.hard_masks(), strict=True):
        assert len(set(mask.view(group.segments, -1).sum(1).tolist())) == 1


def test_a_count_the_groups_cannot_keep_alike_is_refused_before_any_mask():
    """ResNeXt's grouped convs have 4 groups of 8, 16, ... channels: 0.3 keeps 22 of 32
    (not a multiple of 4); the error names the layer and the ratios every one can keep,
    and the model carries no mask."""
    model, x = build("torchvision_resnext")
    with pytest.raises(
        ValueError,
        match=r"layer 'layer1.0.conv1': ratio 0.3 keeps 22 of 32 channels in 4 groups of 8.*"
        r"Ratios every one of these layers can keep: \['0.125', '0.25', '0.375', '0.5', "
        r"'0.625', '0.75', '0.875'\]",
    ):
        DTPPruner(model, (x[:1],), 0.3)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    pruner = DTPPruner(model, (x[:1],), 0.25)
    assert all(k % g.segments == 0 for k, g in zip(pruner.kept, pruner.groups, strict=True))


def test_a_budget_over_several_groups_is_refused_and_a_zero_ratio_leaves_them_whole():
    model, x = build("torchvision_resnext")
    for budget in ("global", "flops"):
        with pytest.raises(
            ValueError,
            match=rf"budget = '{budget}' cannot keep the same number of channels in each "
            r"group of a grouped convolution \(layer 'layer1.0.conv1'",
        ):
            DTPPruner(model, (x[:1],), 0.5, budget=budget)
    probe = DTPPruner(model, (x[:1],), 0.5)
    names = [g.name for g in grouped_groups(probe)]
    probe.remove()
    pruner = DTPPruner(model, (x[:1],), {"*": 0.5, **dict.fromkeys(names, 0)}, budget="global")
    assert not grouped_groups(pruner) and pruner.groups


def test_the_l1_baseline_keeps_as_many_in_each_group():
    model, x = build("torchvision_resnext")
    pruner = L1Pruner(model, (x[:1],), 0.5)
    for group, mask in zip(pruner.groups, pruner.hard_masks(), strict=True):
        assert len(set(mask.view(group.segments, -1).sum(1).tolist())) == 1
    exported = pruner.export().eval()
    assert count_params(exported) == pruner.report()["params_after"]
    assert exported(x).shape == (2, 5)


class DepthMultiplier(nn.Module):
    """A depthwise conv with a channel multiplier of 2 (8 groups, 8 inputs, 16 outputs):
    one input channel per group, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw, self.bn_dw = nn.Conv2d(8, 16, 3, padding=1, groups=8), nn.BatchNorm2d(16)
        self.head = nn.Conv2d(16, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_dw(self.dw(torch.relu(self.bn_a(self.a(x))))))
        return self.head(x).mean((2, 3))


def test_a_depth_multiplier_reading_one_channel_per_group_leaves_them_whole():
    """The channels it reads, one per group, cannot go while every group keeps as many:
    that group is left whole; its outputs, two per group, prune one of each."""
    torch.manual_seed(0)
    model, x = drawn_statistics(DepthMultiplier()).eval(), torch.randn(2, 3, 8, 8)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [(g.name, g.segments) for g in pruner.groups] == [("dw", 8)]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert exported.dw.weight.shape == (8, 1, 3, 3) and exported.dw.groups == 8
