"""RMS norms over a channel group's width (MobileNetV5's RmsNormAct2d after its expansion
conv and after the depthwise conv that follows; its adapter's norm after a pooling),
kept exact as channels go: the hard mask zeroes the removed channels at the root's rows,
and export cuts every norm and scales it with the rows that feed it. A group is adopted
only when the zeros are shown to reach every norm and reader, what lies between a
feeder and its norm is linear, and each norm rescales exactly; any other stays refused
by name."""

import math

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops, count_params
from utils import bfloat16_trained_and_exported

timm = pytest.importorskip("timm")


def tiny_mobilenetv5() -> nn.Module:
    """timm's MobileNetV5 at a few channels: edge residuals, universal inverted
    residuals with and without a depthwise conv between their expansion and projection,
    a multi-query attention block, and the multi-scale fusion adapter whose projection's
    norm is pooled before its last norm."""
    from timm.layers import RmsNorm2d
    from timm.models._efficientnet_builder import decode_arch_def
    from timm.models.mobilenetv5 import _GELU, MobileNetV5

    arch = [
        ["er_r1_k3_s2_e4_c16", "er_r1_k3_s1_e4_c16"],
        ["uir_r1_a3_k5_s2_e6_c24", "uir_r1_a0_k0_s1_e2_c24"],
        ["uir_r1_a5_k5_s2_e4_c32", "mqa_r1_k3_h2_s1_d8_c32", "uir_r1_a0_k0_s1_e2_c32"],
    ]
    torch.manual_seed(0)
    model = MobileNetV5(
        decode_arch_def(arch),
        num_classes=5,
        stem_size=8,
        num_features=48,
        msfa_output_resolution=1,  # 2 x 2 features pooled to 1 x 1 before the last norm
        norm_layer=RmsNorm2d,
        act_layer=_GELU,
        layer_scale_init_value=1e-5,
    )
    with torch.no_grad():  # norms' weights away from 1, so a wrong scale shows
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(torch.rand(param.shape) + 0.5)
    return model.eval()


def norm_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if "Rms" in type(module).__name__
    }


@pytest.mark.parametrize("mask_at", ["auto", "activation"])
def test_mobilenetv5_exports_its_rms_norms_cut_and_rescaled(mask_at):
    model, x = tiny_mobilenetv5(), torch.randn(4, 3, 64, 64)
    dense = norm_weights(model)
    pruner = DTPPruner(model, (x[:1],), 0.5, mask_at=mask_at)
    chains = {g.name: len(g.rms_norms) for g in pruner.groups}
    assert chains["blocks.1.0.pw_exp.conv"] == 2  # its norm, then the depthwise conv's
    assert chains["blocks.1.1.pw_exp.conv"] == 1  # no depthwise conv between
    assert chains["msfa.ffn.pw_proj.conv"] == 2  # its norm, pooled, then the adapter's
    assert not any(g.norms for g in pruner.groups)
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    model.train()
    model(x).square().mean().backward()  # the soft mask passes the scores a gradient
    assert pruner.scores.grad is not None and torch.all(pruner.scores.grad != 0)
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    params, flops = pruner.predicted_counts()
    assert params == count_params(exported) and flops == count_flops(exported, (x[:1],))
    after = norm_weights(exported)
    for name in ("blocks.1.0.pw_exp.bn", "blocks.1.0.dw_mid.bn", "msfa.norm"):
        width, kept = dense[name].numel(), after[name].numel()
        assert kept == width // 2
        unscaled = after[name] * math.sqrt(kept / width)  # the kept dense weights
        assert torch.isclose(unscaled[:, None], dense[name][None]).any(1).all()
    # a norm feeding another keeps its weights as they were
    kept = after["msfa.ffn.pw_proj.bn"]
    assert torch.isclose(kept[:, None], dense["msfa.ffn.pw_proj.bn"][None]).any(1).all()


def test_mobilenetv5_trains_in_bfloat16_and_exports_within_its_rounding():
    bfloat16_trained_and_exported(tiny_mobilenetv5(), torch.randn(4, 3, 64, 64), 0.5)


class MeanNorm2d(nn.Module):
    """A norm over channels with a weight alone that subtracts their mean (a LayerNorm
    without bias): no rescaling keeps it exact."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(1, keepdim=True)
        return x * torch.rsqrt(x.square().mean(1, keepdim=True) + 1e-6) * self.weight[:, None, None]


class L2Norm2d(nn.Module):
    """A norm over channels dividing by their L2 norm, not their root mean square: it
    keeps zeros zero, but the factor that rescales an RMS norm makes it wrong."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.square().sum(1, keepdim=True) + 1e-6)
        return x * scale * self.weight[:, None, None]


class Chain(nn.Module):
    """conv -> norm -> act -> depthwise conv -> norm -> GELU -> conv, each part
    replaceable."""

    def __init__(self, norm=None, act=None, dw_bias=False, between=None) -> None:
        super().__init__()
        from timm.layers import RmsNorm2d

        norm = norm or RmsNorm2d
        self.expand = nn.Conv2d(4, 12, 1)
        self.norm1 = norm(12)
        self.act = act or nn.GELU()
        self.dw = nn.Conv2d(12, 12, 3, padding=1, groups=12, bias=dw_bias)
        self.between = between or nn.Identity()
        self.norm2 = norm(12)
        self.project = nn.Conv2d(12, 4, 1)
        with torch.no_grad():
            self.norm1.weight.copy_(torch.rand(12) + 0.5)
            self.norm2.weight.copy_(torch.rand(12) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dw(self.act(self.norm1(self.expand(x))))
        return self.project(torch.nn.functional.gelu(self.norm2(self.between(h))))


def test_a_chain_of_rms_norms_and_a_depthwise_conv_exports_exactly():
    torch.manual_seed(0)
    model, x = Chain().eval(), torch.randn(2, 4, 8, 8)
    pruner = DTPPruner(model, (x,), 0.5)
    (group,) = pruner.groups
    assert dict(group.rms_norms) == {model.norm1: model.expand, model.norm2: model.dw}
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
        with pruner.hard_masked():
            want = model(x)
    torch.testing.assert_close(pruner.export()(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "make, norm",
    [
        (lambda: Chain(dw_bias=True), "RmsNorm2d 'norm2'"),  # its bias reaches norm2
        (lambda: Chain(act=nn.Sigmoid()), "RmsNorm2d 'norm2'"),  # sigmoid(0) = 0.5
        (lambda: Chain(norm=MeanNorm2d), "MeanNorm2d 'norm1'"),  # subtracts the mean
        (lambda: Chain(norm=L2Norm2d), "L2Norm2d 'norm1'"),  # no mean square
        (lambda: Chain(between=nn.GELU()), "RmsNorm2d 'norm2'"),  # not linear between
    ],
    ids=["depthwise-bias", "sigmoid", "mean-norm", "l2-norm", "gelu-between"],
)
def test_a_chain_the_proofs_do_not_hold_for_stays_refused_by_name(make, norm):
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(2, 4, 8, 8)
    with pytest.raises(ValueError, match=rf"layer 'expand' feeds .*{norm}"):
        DTPPruner(model, (x,), 0.5)


def test_torch_rms_norm_between_linear_layers_exports_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.RMSNorm(12), nn.GELU(), nn.Linear(12, 3)).eval()
    with torch.no_grad():
        model[1].weight.copy_(torch.rand(12) + 0.5)
    x = torch.randn(2, 5, 8)
    pruner = DTPPruner(model, (x,), 0.5)
    assert [len(g.rms_norms) for g in pruner.groups] == [1]
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
        with pruner.hard_masked():
            want = model(x)
    exported = pruner.export()
    assert exported[1].normalized_shape == (6,)
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
