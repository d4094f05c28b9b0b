"""Per-channel affine layers: a module whose forward is `x * weight + bias`, with one
weight and one bias per channel (MobileBERT's NoNorm, which takes a LayerNorm's place
there). Each channel is computed from itself alone, so removing channels leaves the
others as they were, as a BN does. Torch-Pruning sees their parameters as raw tensors
and the pruner would take them for a norm over all channels; registered with it here,
they are per-channel layers whose weight and bias it cuts with the channels, and a
group's mask goes on them as it goes on a BN's affine rows. Which modules have that form
is proven, once per class, on a copy with random parameters, not read from the class
name: over the last dimension (features, after a linear layer) or over dim 1 of a 4-D
tensor (channels, after a 2-D conv: the Scale layer that follows a BN in models
converted from Caffe), and a group takes them only after layers of the form proven.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch_pruning.pruner.function import BasePruningFunc

from .cuts import kept_rows
from .module_tensors import tensor_of

# classes whose form the pruner knows otherwise (norms over all channels, or with
# statistics): never probed
_KNOWN = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.Linear,
    nn.modules.conv._ConvNd,
    nn.Embedding,
)


def _shaped(module: nn.Module) -> bool:
    """Parameters `weight` and `bias`, 1-D and of one width, and nothing else."""
    if isinstance(module, _KNOWN) or next(module.children(), None) is not None:
        return False
    if next(module.buffers(recurse=False), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight", "bias"}:
        return False
    weight, bias = params["weight"], params["bias"]
    return weight.dim() == 1 and bias.shape == weight.shape and weight.numel() > 1


# the two forms proven: features last (a linear layer's output) and channels at dim 1 of
# a conv's (N, C, H, W), the weight and bias broadcast over the rest
LAST, CHANNELS = "last", "channels"


@torch.no_grad()
def _form(module: nn.Module) -> str | None:
    """LAST or CHANNELS when a CPU copy of `module`, given random parameters, computes
    x * weight + bias per channel on a random x of that form (float64); else None."""
    width = tensor_of(module).numel()
    try:
        probe = copy.deepcopy(module).to_empty(device="cpu").double()
    except Exception:
        return None
    generator = torch.Generator().manual_seed(0)
    weight, bias = tensor_of(probe), tensor_of(probe, "bias")
    for parameter in (weight, bias):
        parameter.copy_(torch.randn(width, generator=generator, dtype=torch.float64))
    for form, shape, view in (
        (LAST, (2, 3, width), (width,)),
        (CHANNELS, (2, width, 3, 4), (width, 1, 1)),
    ):
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        try:
            out = probe(x)
        except Exception:  # a forward of another form
            continue
        expected = x * weight.view(view) + bias.view(view)
        if (
            isinstance(out, torch.Tensor)
            and out.shape == expected.shape
            and torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
        ):
            return form
    return None


def channel_affine_forms(model: nn.Module) -> dict[type, str]:
    """The classes in `model` whose modules are per-channel affine layers, with the form
    proven (one proof per class, on its first module)."""
    found, seen = {}, set()
    for module in model.modules():
        kind = type(module)
        if kind in seen or not _shaped(module):
            continue
        seen.add(kind)
        form = _form(module)
        if form is not None:
            found[kind] = form
    return found


class ChannelAffinePruner(BasePruningFunc):
    """Cuts a per-channel affine layer's weight and bias; `form` is the one proven."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def prune_out_channels(self, layer: nn.Module, idxs: list[int]) -> nn.Module:
        gone = set(idxs)
        width = self.get_out_channels(layer)
        weight, bias = tensor_of(layer), tensor_of(layer, "bias")
        keep = torch.tensor(
            [i for i in range(width) if i not in gone], dtype=torch.long, device=weight.device
        )
        layer.weight = kept_rows(weight, keep)
        layer.bias = kept_rows(bias, keep)
        return layer

    prune_in_channels = prune_out_channels

    def get_out_channels(self, layer: nn.Module) -> int:
        return tensor_of(layer).numel()

    get_in_channels = get_out_channels


CHANNEL_AFFINES = {form: ChannelAffinePruner(form) for form in (LAST, CHANNELS)}


def channel_affine_pruners(model: nn.Module) -> dict[type, BasePruningFunc]:
    """Torch-Pruning's `customized_pruners` for the per-channel affine layers in `model`."""
    return {kind: CHANNEL_AFFINES[form] for kind, form in channel_affine_forms(model).items()}
