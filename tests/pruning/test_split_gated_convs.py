"""Gated convolution blocks whose hidden width is split unequally (MambaOut's
GatedConvBlock: fc1 to a gate and a value, part of the value through a depthwise conv,
fc2 reading their product): found by their form, proven on a copy, masked on fc2's
columns and cut neuron by neuron, the conv losing the channels of the removed neurons
past the split; the counts follow which neurons go."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops, count_params
from dtp_kernels.pruning.split_gated_convs import (
    SplitGatedConvGroup,
    _form,
    cut_block,
)

timm = pytest.importorskip("timm")

# the stem's and the head's layers feed LayerNorms over their channels: left whole
WHOLE = {"stem.conv1": 0, "head.pre_logits.fc": 0}


def tiny_mambaout(conv_ratio: float = 1.0) -> nn.Module:
    from timm.models.mambaout import MambaOut

    torch.manual_seed(0)
    model = MambaOut(
        num_classes=5, depths=(1, 1, 1, 1), dims=(8, 12, 16, 24), conv_ratio=conv_ratio
    )
    return model.eval()


@pytest.mark.parametrize("conv_ratio", [1.0, 0.5])
def test_mambaout_blocks_prune_and_export_what_the_masked_model_computes(conv_ratio):
    model, x = tiny_mambaout(conv_ratio), torch.randn(4, 3, 64, 64)
    blocks = [m for m in model.modules() if _form(m) is not None]
    dense = [(b.split_indices, b.fc1.weight.detach().clone()) for b in blocks]
    pruner = DTPPruner(model, (x[:1],), {"*": 0.5, **WHOLE})
    assert [type(g) for g in pruner.groups] == [SplitGatedConvGroup] * 4
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    model.train()
    model(x).square().mean().backward()  # the mask on fc2's columns reaches the scores
    assert torch.all(pruner.scores.grad != 0)
    model.eval()
    masks = pruner.hard_masks()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    params, flops = pruner.predicted_counts()
    assert params == count_params(exported) and flops == count_flops(exported, (x[:1],))
    cut = [m for m in exported.modules() if _form(m) is not None]
    for ((hidden, values, _), weight), block, mask in zip(dense, cut, masks, strict=True):
        keep = mask.nonzero().flatten()
        assert block.split_indices == (
            len(keep),
            int((keep < values).sum()),
            int((keep >= values).sum()),
        )
        rows = torch.cat([keep, hidden + keep])  # each kept neuron's gate row, then its value row
        torch.testing.assert_close(block.fc1.weight, weight[rows], rtol=0, atol=0)


def test_a_block_keeping_no_convolved_neuron_runs_with_an_identity():
    block = tiny_mambaout().stages[0].blocks[0]
    hidden, values, _ = block.split_indices
    x = torch.randn(2, 5, 5, 8)
    keep = torch.arange(values)[::2]  # all before the split
    with torch.no_grad():
        block.fc2.weight[:, [j for j in range(hidden) if j not in keep.tolist()]] = 0
        want = block(x)
        cut_block(block, keep)
        got = block(x)
    assert isinstance(block.conv, nn.Identity) and block.split_indices == (len(keep), len(keep), 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class FixedSplit(nn.Module):
    """A gated convolution block of the same form whose forward splits at its dense sizes
    (read once, not from split_indices): cut, it no longer runs, so it is not adopted."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 24), nn.Linear(12, 8)
        self.conv = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.split_indices = (12, 8, 4)
        self.sizes = list(self.split_indices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, i, c = torch.split(self.fc1(x), self.sizes, dim=-1)
        c = self.conv(c.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return self.fc2(torch.nn.functional.gelu(g) * torch.cat((i, c), dim=-1))


def test_a_block_that_does_not_cut_exactly_is_not_adopted():
    model = FixedSplit().eval()
    with pytest.raises(ValueError, match="the ratios prune nothing of this model"):
        DTPPruner(model, (torch.randn(2, 5, 5, 8),), 0.5)


@pytest.mark.parametrize(
    "change",
    [
        lambda b: setattr(b, "split_indices", (12, 7, 4)),  # the parts do not add up
        lambda b: setattr(b, "conv", nn.Conv2d(4, 4, 3, padding=1)),  # not depthwise
        lambda b: setattr(b, "fc2", nn.Linear(10, 8)),  # reads another width
    ],
    ids=["split", "conv", "fc2"],
)
def test_only_consistent_sizes_are_the_form(change):
    block = FixedSplit()
    assert _form(block) is not None
    change(block)
    assert _form(block) is None
