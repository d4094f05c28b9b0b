"""The proofs a pruner makes at construction run on the model's device and give the same
verdicts there as on the CPU: a conv whose own forward pads first (timm's Conv2dSame)
and a module that passes its channels on prune and export exactly, and a module scaled
by its input's width is refused by name. On a GPU the kept channels' indices are CUDA
tensors, and the proofs' masks of the removed channels are built on the CPU."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.precision import ieee_fp32
from utils import PassedOn, ScaledByWidth, check_export, randomised

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class PadFirst(nn.Conv2d):
    """A conv whose class pads its input on the right and bottom first, as timm's
    Conv2dSame does: its forward is its own, so the weight-transform proof runs on it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(nn.functional.pad(x, (0, 1, 0, 1)))


class Net(nn.Module):
    """Groups `a` (read by `b`), `b` (read by `conv`, a PadFirst) and `conv` (its rows
    masked, no norm after it), whose output `block` reads."""

    def __init__(self, block: type[nn.Module], out: int = 8) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.b, self.bn_b = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv = PadFirst(8, 8, 3, stride=2)
        self.block = block(8)
        self.head = nn.Linear(out, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_a(self.a(x)))
        x = torch.relu(self.bn_b(self.b(x)))
        return self.head(self.block(torch.relu(self.conv(x))).amax((2, 3)))


def model_and_input(block: type[nn.Module], device: str, out: int = 8):
    torch.manual_seed(0)
    x = 10 * torch.randn(2, 3, 12, 12)  # sharp softmaxes: masks show
    return Net(block, out).to(device), x.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_padding_conv_and_a_module_passing_channels_on_prune_on_the_models_device(device):
    model, x = model_and_input(PassedOn, device, out=16)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    assert [g.name for g in pruner.groups] == ["a", "b", "conv"] and pruner.kept == [4] * 3
    with ieee_fp32():  # TF32 convolutions would round the two models apart
        exported = check_export(randomised(pruner), model, x)
    assert exported.conv.weight.device.type == device
    assert type(exported.conv) is PadFirst and exported.conv.weight.shape[:2] == (4, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_module_scaled_by_its_widths_is_refused_on_the_models_device(device):
    model, x = model_and_input(ScaledByWidth, device)
    with pytest.raises(ValueError) as refusal:
        DTPPruner(model, (x[:1],), 0.5)
    message = str(refusal.value)
    assert "layer 'conv' is read by ScaledByWidth 'block' (through 'block.proj')" in message
    assert "computes other values cut to the kept channels than with the removed" in message
    assert "layer 'a'" not in message and "layer 'b'" not in message


@pytest.mark.parametrize("device", DEVICES)
def test_a_pruner_built_on_the_cpu_exports_after_moving_with_its_model(device):
    """The common order: the pruner made on the CPU, then model and pruner moved to the
    GPU. The export's trace and its check run the example inputs (kept on the CPU) on
    the model's device."""
    model, x = model_and_input(PassedOn, "cpu", out=16)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    model.to(device)
    pruner.to(device)
    with ieee_fp32():
        exported = check_export(randomised(pruner), model, x.to(device))
    assert exported.conv.weight.device.type == device and pruner.kept == [4] * 3
