"""The inner channels of Mamba mixers (Mamba, FalconMamba, Jamba's): one group per mixer.

A Mamba (selective state-space) mixer widens the hidden state to I inner channels with
``in_proj`` (rows j and I + j: channel j's input x_j and its gate z_j), runs a causal
depthwise ``conv1d`` and its activation over each channel, and scans each channel j
alone: y_j = C . h_j + D_j x_j with h_j(t) = exp(dt_j A_j) h_j(t - 1) + dt_j B x_j,
where dt, B and C come from ``x_proj`` over all channels (through ``dt_proj``); then
``out_proj`` reads y * act(z). A channel's state starts at zero, so when x_j is zero
(its conv row and bias zeroed, and act(0) = 0) channel j outputs zero and ``x_proj``
reads nothing from it: that is exactly removing channel j, which is ``in_proj`` rows j
and I + j, ``conv1d`` channel j, ``x_proj`` column j, ``dt_proj`` row j, ``A_log``
row j, ``D_j`` and ``out_proj`` column j.

The mask goes on ``conv1d``'s rows and bias as a parametrization: the mixers hand
``conv1d.weight`` to fused kernels instead of calling the layer, and a parametrization
is what every read of the weight sees. A mixer is recognised by those attributes and
their shapes and kept only when proven on its example input (proof.py). Mamba-2 mixers
(heads of channels, a norm over them) are mamba2.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .cuts import cut_depthwise, cut_linear, kept_rows
from .groups import ChannelGroup
from .proof import cuts_exactly, dropped, example_calls


@dataclass(eq=False)
class MambaGroup(ChannelGroup):
    """A Mamba mixer's inner channels: `layer` is its in_proj, `rows` its conv1d (where
    the mask goes), `tables` its per-channel parameters (A_log, D) cut at export."""

    mixer: nn.Module | None = None
    tables: list[tuple[nn.Module, str, int]] = field(default_factory=list)

    @property
    def width(self) -> dict[nn.Module, int]:
        return {self.layer: 2}  # in_proj loses channel j's input row and its gate row

    def unit_weights(self) -> torch.Tensor:
        """Per channel: its in_proj rows (input and gate) and its out_proj column."""
        mixer, size = self.mixer, self.size
        rows = mixer.in_proj.weight.detach().view(2, size, -1).transpose(0, 1)
        return torch.cat([rows.reshape(size, -1), mixer.out_proj.weight.detach().t()], dim=1)

    def channels(self, units: torch.Tensor) -> torch.Tensor:
        return units

    def cut(self, mixer: nn.Module, keep: torch.Tensor) -> None:
        cut_channels(mixer, keep)


def _width(mixer: nn.Module) -> int | None:
    """I, when `mixer` has the Mamba mixer's layers and parameters in their shapes."""
    layers = [getattr(mixer, n, None) for n in ("in_proj", "x_proj", "dt_proj", "out_proj")]
    conv, a_log, d = (getattr(mixer, n, None) for n in ("conv1d", "A_log", "D"))
    if not all(isinstance(m, nn.Linear) for m in layers) or not isinstance(conv, nn.Conv1d):
        return None
    if not (isinstance(a_log, nn.Parameter) and isinstance(d, nn.Parameter)):
        return None
    in_proj, x_proj, dt_proj, out_proj = layers
    width = conv.out_channels
    depthwise = conv.groups == conv.in_channels == width
    if not (
        depthwise
        and width > 1
        and in_proj.out_features == 2 * width
        and x_proj.in_features == dt_proj.out_features == out_proj.in_features == width
        and a_log.dim() == 2
        and a_log.shape[0] == width
        and tuple(d.shape) == (width,)
    ):
        return None
    return width


def _zero(mixer: nn.Module, keep: torch.Tensor) -> None:
    """What the hard mask does: the dropped channels' conv rows and bias zeroed."""
    conv = mixer.conv1d
    drop = dropped(conv.out_channels, keep, conv.weight.device)
    conv.weight[drop] = 0
    if conv.bias is not None:
        conv.bias[drop] = 0


def cut_channels(mixer: nn.Module, keep: torch.Tensor) -> None:
    """Remove the inner channels not in `keep` (sorted indices) from a Mamba mixer."""
    width = mixer.conv1d.out_channels
    keep = keep.cpu()
    cut_linear(mixer.in_proj, torch.cat([keep, keep + width]))  # input and gate rows
    cut_depthwise(mixer.conv1d, keep)
    cut_linear(mixer.x_proj, keep, dim=1)
    cut_linear(mixer.dt_proj, keep)
    cut_linear(mixer.out_proj, keep, dim=1)
    mixer.A_log = kept_rows(mixer.A_log, keep)
    mixer.D = kept_rows(mixer.D, keep)
    if getattr(mixer, "intermediate_size", None) == width:
        mixer.intermediate_size = len(keep)


def find_mamba_groups(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple
) -> list[MambaGroup]:
    """One group per Mamba mixer of `model` that runs on `inputs` and cuts exactly, none
    of whose layers is in `ignored`, in model order."""
    ignored_set = set(ignored)
    mixers = {
        name: module
        for name, module in model.named_modules()
        if _width(module) is not None
        and module not in ignored_set
        and not set(module.children()) & ignored_set
    }
    if not mixers:
        return []
    calls = example_calls(model, list(mixers.values()), inputs)
    groups = []
    for name, mixer in mixers.items():
        width = _width(mixer)
        if mixer not in calls or not cuts_exactly(mixer, calls[mixer], width, _zero, cut_channels):
            continue
        groups.append(
            MambaGroup(
                name,
                mixer.in_proj,
                None,
                width,
                [mixer.in_proj, mixer.conv1d, mixer.dt_proj],
                [mixer.x_proj, mixer.out_proj],
                rows=mixer.conv1d,
                mixer=mixer,
                tables=[(mixer, "A_log", 0), (mixer, "D", 0)],
            )
        )
    return groups


def prune_mamba(group, names: dict[str, nn.Module], mask: torch.Tensor) -> None:
    """Cut the units (a Mamba mixer's channels, a Mamba-2 mixer's heads) whose hard mask
    is 0 from the exported copy's mixer (`names`: the copy's modules by name)."""
    keep = mask.nonzero().flatten()
    if len(keep) < len(mask):
        group.cut(names[group.name], keep)
