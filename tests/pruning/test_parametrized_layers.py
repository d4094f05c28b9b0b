"""Layers the model parametrizes itself (a weight norm through torch's parametrizations,
as wav2vec 2.0's positional convolution and vocoders' convs are written): one left whole
keeps its parametrization in the export and in the model; one that a pruned group cuts
is refused by name before any mask (export cannot cut a computed weight), and prunes
once the parametrization is folded into its weight."""

import ast
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.masking import MaskSource, ScaleRows, strip_parametrizations
from utils import randomised, tiny_speech_encoder

transformers = pytest.importorskip("transformers")


class NormedConvs(nn.Module):
    """conv -> relu -> conv -> pool -> linear; the first conv weight-normed when asked."""

    def __init__(self, normed: bool) -> None:
        super().__init__()
        self.first, self.second = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)
        if normed:
            weight_norm(self.first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.second(torch.relu(self.first(x)))
        return self.head(torch.relu(hidden).mean((2, 3)))


def test_a_weight_normed_layer_a_group_cuts_is_refused_by_name_and_prunes_once_folded():
    torch.manual_seed(0)
    model, x = NormedConvs(normed=True), torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match=r"layer 'first': weight by \['_WeightNorm'\]") as error:
        DTPPruner(model, (x,), 0.5)
    assert "remove_parametrizations" in str(error.value)
    assert list(model.first.parametrizations) == ["weight"]  # nothing mutated
    assert not parametrize.is_parametrized(model.second)
    suggested = ast.literal_eval(str(error.value).rpartition("ratios=")[2])
    pruner = DTPPruner(model, (x,), suggested)
    assert [g.name for g in pruner.groups] == ["second"]
    pruner.remove()
    parametrize.remove_parametrizations(model.first, "weight")  # folded: prunes
    assert [g.name for g in DTPPruner(model, (x,), 0.5).groups] == ["first", "second"]


@pytest.mark.parametrize("family", ["Wav2Vec2", "Hubert"])
def test_speech_encoders_keep_their_weight_normed_positional_conv_through_export(family):
    """wav2vec 2.0's and HuBERT's heads and MLPs prune (the feature extractor, feeding a
    LayerNorm, left whole); the positional convolution's weight norm, on no pruned
    group, stays in the export (counted as its own parameters) and in the model after
    remove()."""
    model, wave = tiny_speech_encoder(family), torch.randn(2, 4000, generator=torch.Generator())
    base = getattr(model, family.lower())
    conv = base.encoder.pos_conv_embed.conv
    ratios = {"*": 0.5, f"{family.lower()}.feature_extractor.conv_layers.1.conv": 0}
    pruner = randomised(DTPPruner(model, (wave[:1],), ratios))
    assert {type(g).__name__ for g in pruner.groups} == {"HeadGroup", "ChannelGroup"}
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(wave).logits
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(wave).logits, want, rtol=1e-5, atol=1e-5)
    kept = getattr(exported, family.lower()).encoder.pos_conv_embed.conv
    assert list(kept.parametrizations) == ["weight"] and type(kept).__name__ == type(conv).__name__
    assert count_params(exported) == pruner.report()["params_after"]
    pruner.remove()
    assert list(conv.parametrizations) == ["weight"]
    assert not any(parametrize.is_parametrized(m) for m in model.modules() if m is not conv)
    with torch.no_grad():
        model(wave)  # the model's class and its parametrization still work


def test_stripping_masks_off_a_copy_keeps_the_models_own_parametrizations_on_both():
    """A layer whose bias carries a mask and whose weight a weight norm: its deep copy
    (as export makes) loses the mask and keeps the norm, in a class of its own, so the
    original keeps both."""
    layer = weight_norm(nn.Linear(4, 3))
    source = MaskSource([3])
    source.set(torch.tensor([1.0, 0.0, 1.0]))
    parametrize.register_parametrization(layer, "bias", ScaleRows(source, 0))
    copied = copy.deepcopy(layer)
    strip_parametrizations(copied)
    assert list(copied.parametrizations) == ["weight"] and "bias" in copied._parameters
    x = torch.randn(2, 4)
    with torch.no_grad():
        masked = layer(x)
        plain = copied(x)
    torch.testing.assert_close(masked[:, 1], plain[:, 1] - copied.bias[1])
    assert list(layer.parametrizations) == ["weight", "bias"]
    assert type(copied) is not type(layer) and type(copied).__name__ == type(layer).__name__


def test_a_mask_stacked_on_the_models_own_parametrization_is_not_stripped_silently():
    """A mask on top of a weight norm of the same tensor (the pruner refuses such layers
    before any mask) would leave the mask in the export: stripping says so instead."""
    layer = weight_norm(nn.Linear(4, 3))
    source = MaskSource([3])
    source.set(torch.ones(3))
    parametrize.register_parametrization(layer, "weight", ScaleRows(source, 0))
    with pytest.raises(RuntimeError, match=r"masks on top of the model's own .* \['weight'\]"):
        strip_parametrizations(copy.deepcopy(layer))


class TwoRefusals(nn.Module):
    """a feeds a LayerNorm; c is weight-normed (so b, which it reads, is refused too); d
    prunes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.c, self.d, self.head = weight_norm(nn.Linear(8, 8)), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b(torch.relu(self.norm(self.a(x)))))
        return self.head(torch.relu(self.d(torch.relu(self.c(x)))))


def test_refusals_of_different_kinds_come_in_one_error_whose_ratios_prune_the_rest():
    """Each kind of refusal is checked and all are given at once, so the ratios the error
    ends with are the last try, not the first of several."""
    model, x = TwoRefusals(), torch.randn(4, 6)
    with pytest.raises(ValueError) as error:
        DTPPruner(model, (x[:1],), 0.5)
    message = str(error.value)
    assert "model parametrizes tensors of layers they cut (layer 'c': weight by" in message
    assert "layer 'a' feeds LayerNorm 'norm'" in message
    ratios = ast.literal_eval(message.rsplit("ratios=", 1)[1])
    assert ratios == {"*": 0.5, "b": 0, "c": 0, "a": 0}
    assert not any(parametrize.is_parametrized(m, "bias") for m in model.modules())
    pruner = randomised(DTPPruner(model, (x[:1],), ratios))
    assert [g.name for g in pruner.groups] == ["d"]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(pruner.export()(x), want)
