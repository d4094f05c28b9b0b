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
from .module_tensors import tensor_of
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
        parts, size = parts_of(self.mixer), self.size
        rows = parts.in_proj.weight.detach().view(2, size, -1).transpose(0, 1)
        return torch.cat([rows.reshape(size, -1), parts.out_proj.weight.detach().t()], dim=1)

    def channels(self, units: torch.Tensor) -> torch.Tensor:
        return units

    def cut(self, mixer: nn.Module, keep: torch.Tensor) -> None:
        cut_channels(mixer, keep)


@dataclass(frozen=True)
class MixerParts:
    """A Mamba mixer's layers and per-channel parameters, as the module docstring has
    them, and its inner width I."""

    in_proj: nn.Linear
    conv1d: nn.Conv1d
    x_proj: nn.Linear
    dt_proj: nn.Linear
    out_proj: nn.Linear
    width: int


def _form(mixer: nn.Module) -> MixerParts | None:
    """`mixer`'s parts, when it has the Mamba mixer's layers and parameters in their
    shapes; else None."""
    in_proj, x_proj, dt_proj, out_proj = (
        getattr(mixer, n, None) for n in ("in_proj", "x_proj", "dt_proj", "out_proj")
    )
    conv, a_log, d = (getattr(mixer, n, None) for n in ("conv1d", "A_log", "D"))
    if not (
        isinstance(in_proj, nn.Linear)
        and isinstance(x_proj, nn.Linear)
        and isinstance(dt_proj, nn.Linear)
        and isinstance(out_proj, nn.Linear)
        and isinstance(conv, nn.Conv1d)
    ):
        return None
    if not (isinstance(a_log, nn.Parameter) and isinstance(d, nn.Parameter)):
        return None
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
    return MixerParts(in_proj, conv, x_proj, dt_proj, out_proj, width)


def parts_of(mixer: nn.Module | None) -> MixerParts:
    """The parts of `mixer`, a Mamba mixer (TypeError naming it if not)."""
    parts = _form(mixer) if mixer is not None else None
    if parts is None:
        raise TypeError(f"a {type(mixer).__name__} is not a Mamba mixer of the known form")
    return parts


def _zero(mixer: nn.Module, keep: torch.Tensor) -> None:
    """What the hard mask does: the dropped channels' conv rows and bias zeroed."""
    conv = parts_of(mixer).conv1d
    drop = dropped(conv.out_channels, keep, conv.weight.device)
    conv.weight[drop] = 0
    if conv.bias is not None:
        conv.bias[drop] = 0


def cut_channels(mixer: nn.Module, keep: torch.Tensor) -> None:
    """Remove the inner channels not in `keep` (sorted indices) from a Mamba mixer."""
    parts = parts_of(mixer)
    width = parts.width
    keep = keep.cpu()
    cut_linear(parts.in_proj, torch.cat([keep, keep + width]))  # input and gate rows
    cut_depthwise(parts.conv1d, keep)
    cut_linear(parts.x_proj, keep, dim=1)
    cut_linear(parts.dt_proj, keep)
    cut_linear(parts.out_proj, keep, dim=1)
    for name in ("A_log", "D"):
        setattr(mixer, name, kept_rows(tensor_of(mixer, name), keep))
    if getattr(mixer, "intermediate_size", None) == width:
        setattr(mixer, "intermediate_size", len(keep))  # noqa: B010 (an int on any module)


def find_mamba_groups(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple
) -> list[MambaGroup]:
    """One group per Mamba mixer of `model` that runs on `inputs` and cuts exactly, none
    of whose layers is in `ignored`, in model order."""
    ignored_set = set(ignored)
    found = {
        name: (module, parts)
        for name, module in model.named_modules()
        if (parts := _form(module)) is not None
        and module not in ignored_set
        and not set(module.children()) & ignored_set
    }
    if not found:
        return []
    calls = example_calls(model, [mixer for mixer, _ in found.values()], inputs)
    groups = []
    for name, (mixer, parts) in found.items():
        width = parts.width
        if mixer not in calls or not cuts_exactly(mixer, calls[mixer], width, _zero, cut_channels):
            continue
        groups.append(
            MambaGroup(
                name,
                parts.in_proj,
                None,
                width,
                [parts.in_proj, parts.conv1d, parts.dt_proj],
                [parts.x_proj, parts.out_proj],
                rows=parts.conv1d,
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
