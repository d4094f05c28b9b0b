"""A group whose channels are read inside a module that uses its input's width (timm's
LambdaLayer reshapes its output to it) is refused by name at construction, before
anything of the model changes, instead of failing export() after training; a module
that passes the channels on is left to export's check, and prunes exactly."""

import ast
import re

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from utils import PassedOn, ScaledByWidth, check_export, randomised

timm = pytest.importorskip("timm")


class ReshapeToInput(nn.Module):
    """Its output reshaped to its input's shape, as LambdaLayer does (its projection's
    width is its own: a softmax over it keeps it out of the groups). The projection sits
    in a Sequential, so the module that fails is the reader's grandparent."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(width, width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        return self.proj(x).softmax(1).reshape(b, c, h, w)


class Net(nn.Module):
    """Groups `a` (read by `b`) and `b` (read inside `block`)."""

    def __init__(self, block: type[nn.Module], out: int = 8) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.b, self.bn_b = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.block = block(8)
        self.head = nn.Linear(out, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_a(self.a(x)))
        x = torch.relu(self.bn_b(self.b(x)))
        return self.head(self.block(x).amax((2, 3)))


@pytest.mark.parametrize(
    "block, failure",
    [
        (ReshapeToInput, r"fails cut to the kept channels \(RuntimeError: shape"),
        (ScaledByWidth, "computes other values cut to the kept channels than with the removed"),
    ],
    ids=["reshape", "scale"],
)
def test_a_group_read_by_a_module_using_its_width_is_refused_and_the_rest_prunes(block, failure):
    torch.manual_seed(0)
    model, x = Net(block), 10 * torch.randn(2, 3, 8, 8)  # sharp softmaxes: masks show
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as refusal:
        DTPPruner(model, (x[:1],), 0.5)
    message = str(refusal.value)
    reader = "'block.proj.0'" if block is ReshapeToInput else "'block.proj'"
    assert f"layer 'b' is read by {block.__name__} 'block' (through {reader}), which" in message
    assert re.search(failure, message)
    assert "layer 'a'" not in message
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    suggested = ast.literal_eval(message.rpartition("ratios=")[2])
    assert suggested == {"*": 0.5, "b": 0}
    pruner = DTPPruner(model, (x[:1],), suggested)
    assert [g.name for g in pruner.groups] == ["a"] and pruner.kept == [4]
    check_export(randomised(pruner), model, x)


def test_a_module_passing_the_channels_on_is_left_to_export_and_prunes_exactly():
    torch.manual_seed(0)
    model, x = Net(PassedOn, out=16), 10 * torch.randn(2, 3, 8, 8)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    assert [g.name for g in pruner.groups] == ["a", "b"] and pruner.kept == [4, 4]
    check_export(randomised(pruner), model, x)


def test_timm_lambda_resnet_is_refused_at_construction_and_prunes_the_rest():
    torch.manual_seed(0)
    model = timm.create_model("lambda_resnet26t", num_classes=5).eval()
    x = torch.randn(2, 3, 64, 64)
    with pytest.raises(ValueError) as refusal:
        DTPPruner(model, (x[:1],), 0.5)
    message = str(refusal.value)
    lambdas = [n for n, m in model.named_modules() if type(m).__name__ == "LambdaLayer"]
    for name in lambdas:  # each block's 1x1 conv feeds its lambda layer
        block = name.rpartition(".")[0]
        assert (
            f"layer '{block}.conv1_1x1.conv' is read by LambdaLayer '{name}' (through "
            f"'{name}.qkv'), which fails cut to the kept channels (RuntimeError" in message
        )
    suggested = ast.literal_eval(message.rpartition("ratios=")[2])
    assert suggested == {"*": 0.5} | {f"{n.rpartition('.')[0]}.conv1_1x1.conv": 0 for n in lambdas}
    pruner = DTPPruner(model, (x[:1],), suggested)
    assert len(pruner.groups) == 13
    check_export(randomised(pruner), model, x)  # export's own check passes too


class Block(nn.Module):
    """A residual block with a projection shortcut: its input is read by two convs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.shortcut = nn.Conv2d(width, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))) + self.shortcut(x)


def test_a_group_is_proven_in_the_module_reading_it_not_in_the_container_above(monkeypatch):
    """The stem's channels are read by the first block of a Sequential body: the block is
    proven (a container's code uses no width, and proving it would run the whole body)."""
    from dtp_kernels.pruning import enclosing_readers

    proven, prove = [], enclosing_readers.proof_failure

    def recorded(module, *args):
        proven.append(module)
        return prove(module, *args)

    monkeypatch.setattr(enclosing_readers, "proof_failure", recorded)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Sequential(Block(8), Block(8))
    )
    DTPPruner(model, (torch.randn(1, 3, 8, 8),), {"0": 0.5})
    assert proven == [model[2][0]]
