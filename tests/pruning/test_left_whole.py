"""pruner.left_whole: every conv and linear layer no group cuts, with why. Each layer the
export leaves its full shape is listed, and no other."""

import pytest
import torch
import torchvision
from torch import nn

from dtp_kernels import DTPPruner
from dtp_kernels.models import resnet20
from utils import (
    LLAMA_VOCAB,
    layer_shapes,
    randomised,
    tiny_deepseek,
    tiny_gemma_sharing_kv,
    whole_as_listed,
)


def _tokens(vocab: int) -> tuple:
    return (torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0)),)


# (model, example inputs, ratios): a CNN with residual adds, a Gemma 3n whose first MLP
# keeps activation statistics over all its neurons, a DeepSeek with latent attention
CASES = {
    "resnet18": (lambda: torchvision.models.resnet18(), (torch.randn(1, 3, 64, 64),), 0.5),
    "gemma3n": (lambda: tiny_gemma_sharing_kv("gemma3n", 0.95), _tokens(256), 0.5),
    "deepseek-heads": (lambda: tiny_deepseek(), _tokens(LLAMA_VOCAB), {"heads": 0.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_layers_export_leaves_their_full_shape_are_the_listed_ones(case):
    make, inputs, ratios = CASES[case]
    model = make().eval()
    dense = layer_shapes(model)
    pruner = randomised(DTPPruner(model, inputs, ratios))
    exported = pruner.export()
    assert set(layer_shapes(exported)) == set(dense)
    assert whole_as_listed(exported, dense, pruner.left_whole)
    assert list(pruner.left_whole) == [n for n in dense if n in pruner.left_whole]  # in order
    assert all(why for why in pruner.left_whole.values())
    assert pruner.report()["left_whole"] == pruner.left_whole


def test_a_residual_network_names_the_coupled_layers_and_the_classifier():
    """ResNet-18's stem and downsample convs feed the residual adds, and the classifier
    keeps its outputs; prune_coupled=True prunes the residual widths, the classifier's
    input columns with them."""
    inputs = (torch.randn(1, 3, 64, 64),)
    model = torchvision.models.resnet18().eval()
    whole = DTPPruner(model, inputs, 0.5).left_whole
    coupled = ["conv1", *(f"layer{i}.0.downsample.0" for i in (2, 3, 4))]
    assert list(whole) == [*coupled, "fc"]
    for name in coupled:
        assert "coupled with those of 2 other layers at AddBackward" in whole[name]
        assert "prune_coupled=True" in whole[name]
    assert whole["fc"] == "its outputs are the model's outputs: no layer reads them"
    model = torchvision.models.resnet18().eval()
    assert DTPPruner(model, inputs, 0.5, prune_coupled=True).left_whole == {}


class Upsampled(nn.Module):
    """A transposed conv's output added to a conv's: coupled channels, one of whose
    writers holds them along its weight's second dimension."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(width, 6, 2, stride=2)
        self.stem, self.side = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 6, 3, padding=1)
        self.head = nn.Conv2d(6, 5, 1)

    def forward(self, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        side = self.side(torch.relu(self.stem(x)))
        return self.head(torch.relu(self.up(low) + side))


@pytest.mark.parametrize("coupled", [True, False])
@pytest.mark.parametrize("width", [4, 6])  # 6: the transposed conv's weight is square
def test_channels_a_transposed_conv_writes_are_left_whole_even_coupled(width, coupled):
    """Its output channels lie along its weight's second dimension: left whole, with
    the channels it adds to (the side conv's outputs), coupled or not. Before, with
    prune_coupled=True, the mask went on its first dimension: a shape error, or with a
    square weight its input channels masked in training and the export refused."""
    torch.manual_seed(0)
    model = Upsampled(width).eval()
    inputs = (torch.randn(1, 3, 8, 8), torch.randn(1, width, 4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruner = DTPPruner(model, inputs, 0.5, prune_coupled=coupled)
    assert [g.name for g in pruner.groups] == ["stem"]  # (side: its input channels cut)
    assert pruner.left_whole == {
        "up": "a transposed convolution writes its channels",
        "head": "its outputs are the model's outputs: no layer reads them",
    }
    with torch.no_grad(), randomised(pruner).hard_masked():
        want = model(*inputs)
    torch.testing.assert_close(pruner.export().eval()(*inputs), want, rtol=1e-5, atol=1e-6)
    pruner.remove()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_mlp_with_statistics_over_its_neurons_is_listed_with_where_they_meet():
    """Gemma 3n's first MLP subtracts a cutoff computed over all its neurons from the
    gate (activation sparsity): the gate's channels meet the up projection's there, so
    the MLP is whole; the other layers' MLPs prune."""
    model = tiny_gemma_sharing_kv("gemma3n", 0.95).eval()
    whole = DTPPruner(model, _tokens(256), 0.5).left_whole
    mlps = [n for n in whole if ".mlp." in n]
    assert mlps == [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert "coupled with those of 1 other layer at AddBackward, SubBackward" in whole[mlps[0]]
    assert whole[mlps[2]].startswith("the channels it reads are left whole (its output")


def test_ratio_zero_ignored_idle_and_latent_layers_say_so():
    model = resnet20().eval()
    first = model.layer1[0].conv1
    pruner = DTPPruner(
        model,
        torch.randn(1, 3, 32, 32),
        {"*": 0.5, "layer2.0.conv1": 0},
        ignored_layers=[first],
    )
    whole = pruner.left_whole
    assert whole["layer1.0.conv1"] == "in ignored_layers (or inside one of them)"
    assert whole["layer2.0.conv1"] == "the ratio of its group 'layer2.0.conv1' is 0"
    # the ignored layer's and the ratio-0 group's readers read all their channels too
    assert whole["layer2.0.conv2"] == "the ratio of its group 'layer2.0.conv1' is 0"

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.idle, self.out = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.used(x)))

    with pytest.warns(UserWarning, match="not called on example_inputs"):
        whole = DTPPruner(Branchy(), torch.randn(2, 8), 0.5).left_whole
    assert whole == {"idle": "not called on example_inputs"}  # `out` loses input columns
    whole = DTPPruner(tiny_deepseek().eval(), _tokens(LLAMA_VOCAB), 0.5).left_whole
    latent = "a latent attention's compressed latent: all heads read it"
    assert whole["model.layers.0.self_attn.q_a_proj"] == latent
    assert whole["model.layers.1.self_attn.kv_a_proj_with_mqa"] == latent


class Attended(nn.Module):
    """A linear embedding read by nn.MultiheadAttention and added to its output (a
    residual around it), then a readout; the embedding's width is the attention's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attention = nn.MultiheadAttention(16, 4, batch_first=True)
        self.readout = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.readout(h + self.attention(h, h, h, need_weights=False)[0])


def test_a_width_an_attention_layer_writes_too_is_listed_with_that_layer():
    """Torch-Pruning's search gives no group whose outputs a layer left out of it (the
    heads' projections) writes too: the embedding is listed with that layer, not with
    "no group holds its output channels"."""
    whole = DTPPruner(Attended(), torch.randn(1, 5, 8), 0.5).left_whole
    assert whole["embed"] == (
        "its output channels go with those of 'attention', which the channel search "
        "leaves out (an attention layer's projections, a layer in ignored_layers)"
    )


def test_weights_tied_to_another_module_are_listed_under_weight_granularity():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mix, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.mix(self.embed(ids)))

    with pytest.warns(UserWarning, match="tied"):
        pruner = DTPPruner(Tied(), torch.arange(6)[None], 0.5, granularity="weight")
    assert pruner.left_whole == {
        "head": "its weight is tied to ['embed']'s: a mask would reach one use of it"
    }


def test_a_group_that_keeps_all_its_units_is_listed_as_its_masks_say():
    """A group of one unit keeps it whatever the ratio; under a global budget a group's
    count follows its scores, so the list follows the hard masks."""
    model = nn.Sequential(nn.Linear(4, 1), nn.ReLU(), nn.Linear(1, 3))
    whole = DTPPruner(model, torch.randn(2, 4), 0.5).left_whole
    assert whole == dict.fromkeys(["0", "2"], "its group '0' keeps all its units")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    pruner = DTPPruner(model, torch.randn(2, 4), 0.5, budget="global")
    with torch.no_grad():  # the first group's units above all the second's
        pruner.scores.copy_(torch.tensor([5.0, 6, 7, 8, 1, 2, 3, 4]))
    assert pruner.left_whole == {"0": "its group '0' keeps all its units"}
    with torch.no_grad():
        pruner.scores.copy_(torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 8]))
    assert pruner.left_whole == {"4": "its group '2' keeps all its units"}
    exported = pruner.export()
    assert [m.weight.shape for m in exported if isinstance(m, nn.Linear)] == [
        (1, 4),
        (4, 1),
        (3, 4),
    ]
