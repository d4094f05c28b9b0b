"""Global response normalizations (ConvNeXt V2's GRN) inside an MLP's hidden width, kept
exact as neurons go: the mask also takes the GRN's bias, and export cuts the GRN and
rescales its weight (and its epsilon, where it has one) by C / K. A module is adopted
only when that is proven on a copy of it on its example input; any other norm over the
channels stays refused by name."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.response_norms import (
    cut_response_norm,
    rescale_response_norm,
    rescales_exactly,
)
from utils import ChannelAffine, bfloat16_trained_and_exported, random_params

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

WIDTH, KEEP = 12, torch.tensor([0, 2, 3, 7, 8])


def timm_grn(channels_last: bool = True) -> nn.Module:
    from timm.layers.grn import GlobalResponseNorm

    return GlobalResponseNorm(WIDTH, eps=1e-3, channels_last=channels_last)


def hf_grn() -> nn.Module:
    from transformers.models.convnextv2.modeling_convnextv2 import ConvNextV2GRN

    return ConvNextV2GRN(WIDTH)


class MaxResponseNorm(ChannelAffine):
    """A GRN dividing by the largest channel norm, not the mean: removing a channel can
    change the divisor, and no constant factor undoes that."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.norm(p=2, dim=(1, 2), keepdim=True)
        return x + self.bias + self.weight * x * g / (g.amax(dim=-1, keepdim=True) + 1e-6)


def randomised(norm: nn.Module, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return norm


def masked_and_cut(norm: nn.Module, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """(the norm on x with the channels outside KEEP zeroed and their bias masked, at the
    kept channels; the cut and rescaled norm on the kept channels; the first's values at
    the removed channels)."""
    gone = torch.tensor([c for c in range(WIDTH) if c not in KEEP.tolist()])
    masked = randomised(norm)
    with torch.no_grad():
        masked.bias[..., gone] = 0
        full = masked(x.index_fill(dim, gone, 0))
    cut = randomised(norm)
    cut_response_norm(cut, KEEP)
    rescale_response_norm(cut, WIDTH, len(KEEP))
    with torch.no_grad():
        got = cut(x.index_select(dim, KEEP))
    return full.index_select(dim, KEEP), got, full.index_select(dim, gone)


@pytest.mark.parametrize("channels_last", [True, False])
def test_timm_grn_cut_and_rescaled_computes_what_the_masked_one_does(channels_last):
    dim = 3 if channels_last else 1
    shape = [2, 5, 5, 5]
    shape[dim] = WIDTH
    want, got, removed = masked_and_cut(timm_grn(channels_last), torch.randn(shape), dim)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.all(removed == 0)  # fc2 loses their columns: nothing of them is lost


def test_timm_grn_epsilon_and_weight_are_scaled_by_width_over_kept():
    norm = randomised(timm_grn())
    weight = norm.weight.detach().clone()
    cut_response_norm(norm, KEEP)
    rescale_response_norm(norm, WIDTH, len(KEEP))
    assert norm.eps == pytest.approx(1e-3 * WIDTH / len(KEEP))
    torch.testing.assert_close(norm.weight.detach(), weight[KEEP] * WIDTH / len(KEEP))
    assert norm.bias.shape == (len(KEEP),)


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_hugging_face_grn_differs_by_its_fixed_epsilon_alone(scale):
    """HF's epsilon is fixed at 1e-6 in its code: only the weight is rescaled, and the
    result differs by at most a relative 1e-6 * (C / K - 1) / mean(g) of the normalized
    term, mean(g) the kept channels' mean norm (the module docstring's bound)."""
    x = torch.randn(2, 5, 5, WIDTH, dtype=torch.float64) * scale
    norm = hf_grn().double()
    want, got, removed = masked_and_cut(norm, x, 3)
    assert torch.all(removed == 0)
    kept = x[..., KEEP]
    g = kept.norm(dim=(1, 2), keepdim=True)
    term = randomised(hf_grn()).double().weight[..., KEEP] * kept * g / (g.sum(-1, True) / WIDTH)
    bound = 1e-6 * (WIDTH / len(KEEP) - 1) / g.mean(-1, keepdim=True) * term.abs()
    assert torch.all((got - want).abs() <= bound + 1e-15)
    assert not torch.equal(got, want)  # the bound is what it says, not zero


@pytest.mark.parametrize(
    "make, exact",
    [
        (timm_grn, True),
        (lambda: timm_grn(channels_last=False), True),
        (hf_grn, True),
        (lambda: ChannelAffine(WIDTH), False),
        (lambda: MaxResponseNorm(WIDTH), False),
    ],
    ids=["timm-channels-last", "timm-channels-first", "hugging-face", "affine", "max-norm"],
)
def test_only_a_norm_divided_by_the_mean_channel_norm_is_proven(make, exact):
    norm = make()
    before = [p.detach().clone() for p in norm.parameters()]
    shape = (1, WIDTH, 6, 6) if getattr(norm, "channel_dim", -1) == 1 else (1, 6, 6, WIDTH)
    assert rescales_exactly(norm, torch.randn(shape)) == exact
    assert all(torch.equal(a, b) for a, b in zip(before, norm.parameters(), strict=True))


class MaxNormMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 8)
        self.norm = MaxResponseNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def test_a_norm_the_proof_does_not_hold_for_stays_refused_by_name():
    with pytest.raises(ValueError, match=r"'fc1' feeds MaxResponseNorm 'norm'"):
        DTPPruner(MaxNormMlp(), (torch.randn(1, 4, 4, 8),), {"mlp": 0.5})


def convnextv2(conv_mlp: bool = False) -> nn.Module:
    from timm.models.convnext import ConvNeXt

    torch.manual_seed(0)
    model = ConvNeXt(
        depths=(1, 1, 1, 1),
        dims=(8, 8, 8, 16),
        num_classes=5,
        use_grn=True,
        ls_init_value=None,
        conv_mlp=conv_mlp,
    )
    return random_params(model, "grn")


@pytest.mark.parametrize(
    "conv_mlp, mask_at, ratios",
    [
        (False, "auto", {"mlp": 0.5}),
        (False, "activation", {"mlp": 0.5}),
        (True, "auto", {"channels": 0.5}),  # 1x1 convs: channel groups
        (False, "auto", 0.5),
    ],
    ids=["linear", "activation", "1x1-conv", "float"],
)
def test_convnextv2_exports_its_grns_cut_and_rescaled(conv_mlp, mask_at, ratios):
    model, x = convnextv2(conv_mlp), torch.randn(4, 3, 32, 32)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("grn")}
    pruner = DTPPruner(model, (x[:1],), ratios, mask_at=mask_at)
    assert [len(g.response_norms) for g in pruner.groups if g.name.endswith("fc1")] == [1] * 4
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    model.train()
    model(x).square().mean().backward()  # the bias's mask passes the scores a gradient
    assert torch.all(pruner.scores.grad != 0)
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    for name, module in exported.named_modules():
        if name.endswith("grn"):
            width, kept = dense[name].numel(), module.weight.numel()
            assert kept == width // 2 and module.eps == pytest.approx(1e-6 * width / kept)
            unscaled = module.weight.detach().flatten() * kept / width  # kept dense weights
            assert torch.isclose(unscaled[:, None], dense[name][None]).any(1).all()


def test_convnextv2_trains_in_bfloat16_and_exports_within_its_rounding():
    bfloat16_trained_and_exported(convnextv2(), torch.randn(4, 3, 32, 32), {"mlp": 0.5})
