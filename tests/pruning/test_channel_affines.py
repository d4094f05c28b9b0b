"""Per-channel affine layers (`x * weight + bias` per channel: MobileBERT's NoNorm, a
Caffe model's Scale) inside a group: proven on a copy with random parameters, cut with
the channels, the mask on their weight and bias; a module of the same parameters that
computes anything else stays refused by name."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.channel_affines import CHANNELS, LAST, channel_affine_forms
from dtp_kernels.pruning.cost import count_params
from utils import ChannelAffine, random_params, randomised

transformers = pytest.importorskip("transformers")


class CenteredNorm(ChannelAffine):
    """The same parameters, but each channel less the mean of all: at its initial values
    (weight 1, bias 0) it is no identity either, yet only the proof can tell its form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) * self.weight + self.bias


class Scale(ChannelAffine):
    """The same over the channels of a conv's output (the Scale layer of models converted
    from Caffe)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.view(-1, 1, 1) + self.bias.view(-1, 1, 1)


class Mlp(nn.Module):
    def __init__(self, between: type, conv: bool = False) -> None:
        super().__init__()
        make = (lambda i, o: nn.Conv2d(i, o, 1)) if conv else nn.Linear
        self.fc1, self.fc2 = make(6, 8), make(8, 5)
        self.between = between(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.between(self.fc1(x))))


def test_the_proof_decides_not_the_name_or_the_parameters():
    forms = channel_affine_forms(nn.Sequential(Mlp(ChannelAffine), Mlp(CenteredNorm), Mlp(Scale)))
    assert forms == {ChannelAffine: LAST, Scale: CHANNELS}
    norms = nn.Sequential(nn.LayerNorm(8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    assert channel_affine_forms(norms) == {}


@pytest.mark.parametrize("mask_at", ["auto", "activation"])
@pytest.mark.parametrize("between, shape", [(ChannelAffine, (3, 6)), (Scale, (3, 6, 5, 4))])
def test_an_affine_layer_is_cut_with_the_channels_it_follows(between, shape, mask_at):
    torch.manual_seed(0)
    model = random_params(Mlp(between, conv=len(shape) == 4), "between")
    x = torch.randn(shape)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5, mask_at=mask_at))
    assert [g.name for g in pruner.groups] == ["fc1"]
    assert parametrize.is_parametrized(model.between, "bias") == (mask_at == "auto")
    with torch.no_grad():
        dense = model(x)
        with pruner.hard_masked():
            want = model(x)
    assert (want - dense).abs().max() > 1e-3
    exported = pruner.export()
    assert exported.between.weight.shape == exported.between.bias.shape == (4,)
    torch.testing.assert_close(exported(x), want, rtol=1e-6, atol=1e-6)
    assert count_params(exported) == pruner.report()["params_after"]


def test_a_module_of_other_form_stays_refused_by_name():
    with pytest.raises(ValueError, match=r"'fc1' feeds CenteredNorm 'between'"):
        DTPPruner(Mlp(CenteredNorm), (torch.randn(3, 6),), 0.5)


def test_a_form_proven_over_features_does_not_pass_for_channels():
    """ChannelAffine is proven over the last dimension, which is not a conv's channels: the
    group through it stays whole."""
    with pytest.raises(ValueError, match=r"'fc1'.* match no prunable layer"):
        DTPPruner(Mlp(ChannelAffine, conv=True), (torch.randn(1, 6, 8, 8),), {"fc1": 0.5})


def tiny_mobilebert() -> nn.Module:
    config = transformers.MobileBertConfig(
        vocab_size=100,
        hidden_size=64,
        embedding_size=32,
        true_hidden_size=32,
        intra_bottleneck_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_feedforward_networks=2,
        max_position_embeddings=64,
        num_labels=3,
    )
    torch.manual_seed(0)
    return random_params(transformers.MobileBertForSequenceClassification(config), "LayerNorm")


@pytest.mark.parametrize("mask_at", ["auto", "activation"])
def test_mobilebert_prunes_its_shared_query_key_bottleneck_through_no_norm(mask_at):
    """MobileBERT's NoNorm (its default normalization) is per channel: the bottleneck
    that feeds queries and keys prunes with a float ratio, where it was refused as a
    norm over all channels, and the export equals the hard-masked model."""
    model = tiny_mobilebert()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    pruner = randomised(DTPPruner(model, (ids,), 0.5, mask_at=mask_at))
    names = [g.name for g in pruner.groups]
    for layer in range(2):
        assert f"mobilebert.encoder.layer.{layer}.bottleneck.attention.dense" in names
    model.train()
    model(ids, labels=torch.tensor([0, 2])).loss.backward()
    index = names.index("mobilebert.encoder.layer.0.bottleneck.attention.dense")
    start = sum(pruner.sizes[:index])
    assert pruner.scores.grad[start : start + pruner.sizes[index]].abs().sum() > 0
    model.eval()
    with torch.no_grad():
        dense = model(ids).logits
        with pruner.hard_masked():
            want = model(ids).logits
    assert (want - dense).abs().max() > 1e-3
    with pytest.warns(UserWarning, match="config cannot describe its sizes"):
        exported = pruner.export().eval()
    bottleneck = exported.mobilebert.encoder.layer[0].bottleneck.attention
    assert bottleneck.dense.out_features == bottleneck.LayerNorm.weight.numel() == 16
    assert exported.mobilebert.encoder.layer[0].attention.self.query.in_features == 16
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
