"""Conv layers that transform their weight in their forward (weight standardization: BiT,
NFNet) are refused by name when asked to lose channels, at construction and before
anything of the model changes, instead of failing export() after training; a subclass
that only pads (timm's Conv2dSame) still prunes, exactly."""

import ast
import functools

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.weight_transforms import (
    cuts_inputs_exactly,
    overrides_forward,
    scales_rows_exactly,
)

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def std_conv(cin: int, cout: int) -> nn.Module:
    from timm.layers import StdConv2d

    return StdConv2d(cin, cout, 3, padding=1)


def same_conv(cin: int, cout: int) -> nn.Module:
    from timm.layers.conv2d_same import Conv2dSame

    return Conv2dSame(cin, cout, 3, stride=2)


def plain_conv(cin: int, cout: int) -> nn.Module:
    return nn.Conv2d(cin, cout, 3, padding=1)


@pytest.mark.parametrize(
    "make, overrides, exact",
    [(plain_conv, False, True), (same_conv, True, True), (std_conv, True, False)],
    ids=["conv2d", "conv2d-same", "std-conv"],
)
def test_only_a_forward_linear_in_the_stored_weight_passes_both_proofs(make, overrides, exact):
    torch.manual_seed(0)
    layer, x = make(8, 6), torch.randn(2, 8, 9, 9)
    before = layer.weight.detach().clone()
    assert overrides_forward(layer) == overrides
    assert cuts_inputs_exactly(layer, x) == exact
    assert scales_rows_exactly(layer, x) == exact
    assert torch.equal(layer.weight, before)  # proven on copies


def assert_export_equal(pruner, model: nn.Module, x: torch.Tensor) -> None:
    """The export after scores in a random order equals the hard-masked model on x."""
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(pruner.export().eval()(x), want, rtol=1e-5, atol=1e-5)


class Net(nn.Module):
    """Three conv groups: `a` feeds a plain conv, `b` feeds `conv` (a weight-standardized
    one, when asked), which takes its own mask on its rows (no norm after it); with
    `root`, `b` itself standardizes its weight and takes the mask on its rows."""

    def __init__(self, conv, root: bool = False) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.b = std_conv(8, 8) if root else nn.Conv2d(8, 8, 3, padding=1)
        self.bn_b = nn.Identity() if root else nn.BatchNorm2d(8)
        self.conv = conv(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_a(self.a(x)))
        x = torch.relu(self.bn_b(self.b(x)))
        return self.head(self.conv(x).mean((2, 3)))


def test_a_group_feeding_a_weight_standardized_conv_is_refused_and_the_rest_prunes():
    torch.manual_seed(0)
    model, x = Net(std_conv), torch.randn(2, 3, 16, 16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as refusal:
        DTPPruner(model, (x[:1],), 0.5)
    message = str(refusal.value)
    assert "layer 'b': StdConv2d 'conv', cut to fewer input channels" in message
    assert "layer 'conv': StdConv2d 'conv', whose rows take the mask" in message
    assert "layer 'a'" not in message
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    suggested = ast.literal_eval(message.rpartition("ratios=")[2])
    assert suggested == {"*": 0.5, "b": 0, "conv": 0}
    pruner = DTPPruner(model, (x[:1],), suggested)
    assert [g.name for g in pruner.groups] == ["a"] and pruner.kept == [4]
    assert_export_equal(pruner, model, x)


def test_a_weight_standardized_root_taking_the_mask_on_its_rows_is_refused():
    model, x = Net(plain_conv, root=True), torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"StdConv2d 'b', whose rows take the mask, does not"):
        DTPPruner(model, (x[:1],), {"b": 0.5})


def test_a_conv_that_only_pads_prunes_and_exports_equal():
    torch.manual_seed(0)
    model, x = Net(same_conv), torch.randn(2, 3, 16, 16)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    assert [g.name for g in pruner.groups] == ["a", "b", "conv"] and pruner.kept == [4] * 3
    assert_export_equal(pruner, model, x)


def hf_bit():
    config = transformers.BitConfig(
        embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4, num_labels=5
    )
    return transformers.BitForImageClassification(config), torch.randn(1, 3, 32, 32)


def timm_resnetv2():
    from timm.layers import GroupNormAct
    from timm.models.resnetv2 import ResNetV2

    norm = functools.partial(GroupNormAct, num_groups=4)
    model = ResNetV2(layers=(1, 1), channels=(16, 32), stem_chs=16, norm_layer=norm)
    return model, torch.randn(1, 3, 32, 32)


def timm_nfnet():
    from timm.models.nfnet import NfCfg, NormFreeNet

    cfg = NfCfg(depths=(1, 1), channels=(16, 32), stem_chs=8, group_size=None, num_features=0)
    return NormFreeNet(cfg, num_classes=5), torch.randn(1, 3, 32, 32)


@pytest.mark.parametrize(
    "build, conv",
    [
        (hf_bit, "WeightStandardizedConv2d"),
        (timm_resnetv2, "StdConv2d"),
        (timm_nfnet, "ScaledStdConv2d"),
    ],
    ids=["hf-bit", "timm-resnetv2", "timm-nfnet"],
)
def test_bit_and_nfnet_are_refused_by_name_at_construction(build, conv):
    model, x = build()
    with pytest.raises(ValueError, match=rf"{conv} '[\w.]+', cut to fewer input channels"):
        DTPPruner(model, (x,), 0.5)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())


def test_a_scaled_std_convs_gain_counts_in_the_predicted_parameters():
    """NFNet's ScaledStdConv2d holds a gain per filter besides its weight and bias: left
    whole, it keeps it, and the report's parameters after pruning count it as the
    export has it."""
    from timm.layers import ScaledStdConv2d

    torch.manual_seed(0)
    model = nn.Sequential(
        ScaledStdConv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
        nn.Conv2d(16, 4, 1),
    )  # fmt: skip
    x = torch.randn(2, 3, 12, 12)
    pruner = DTPPruner(model, (x[:1],), {"*": 0.5, "0": 0})
    assert [g.name for g in pruner.groups] == ["2"]
    assert_export_equal(pruner, model, x)
    exported = pruner.export()
    assert exported[0].gain.shape == (8, 1, 1, 1)
    assert pruner.report()["params_after"] == sum(p.numel() for p in exported.parameters())
