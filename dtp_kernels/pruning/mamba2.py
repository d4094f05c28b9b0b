"""The heads of Mamba-2 mixers (Mamba2, and the hybrids built on its mixer): one group per
mixer, a head of `head_dim` channels per unit.

A Mamba-2 mixer projects the hidden state with ``in_proj`` into the gate z (I = H * P
channels: H heads of P), the inputs x (I), B and C (G * N each: G groups of heads share
them) and dt (one per head); runs a causal depthwise ``conv1d`` and its activation over
x, B and C; scans each head alone: y_h = C . s_h + D_h x_h with s_h(t) =
exp(dt_h A_h) s_h(t - 1) + dt_h B x_h (A_h = -exp(A_log_h), dt through softplus with
dt_bias_h); normalizes y * silu(z) by an RMS norm over each group's channels; and
``out_proj`` reads the result. A head's state starts at zero, so when its x is zero (its
conv rows and bias zeroed, act(0) = 0) it outputs zero: the mask goes on those conv
rows (a parametrization: fused kernels read ``conv1d.weight``), and the B and C channels
all heads read stay whole.

The norm then sees zeros in the removed heads' channels. With K of its group's N channels
kept, its mean square over the kept ones is the sum over K / N, so export cuts it to the
kept channels, scales its weight by sqrt(N / K) and its epsilon by N / K, which computes
exactly what it computed (no weight of the mixer scales its input linearly: x, B and C
pass through the activation). Every group keeps the same number of heads (one epsilon
per norm, and the scan gives head h the group h // (H / G), by position): the heads are
G transport segments of H / G, each keeping k / G, under budget
"layer" (a count that does not split over the groups is refused by name). The epsilon is
the mixer's own, so the model's config cannot describe the exported mixers: save them
with ``save_pruned``. Falcon-H1's mixer is this form with its norm optional (nothing to
rescale without it) and a buffer of muP multipliers per in_proj output (``mup_vector``),
cut with in_proj's rows. A mixer is recognised by its attributes and shapes and kept
only when proven on its example input (proof.py), a head drawn in each group alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .cuts import cut_depthwise, cut_linear, kept_rows
from .groups import ChannelGroup
from .proof import cuts_exactly, example_calls
from .ratios import kept_count


@dataclass(frozen=True)
class Mamba2Form:
    """A Mamba-2 mixer's sizes: heads H of head_dim P, groups G of state size N."""

    heads: int
    head_dim: int
    groups: int
    state: int
    normed: bool = True  # a gated RMS norm over each group's channels (Falcon-H1's optional)

    @property
    def inner(self) -> int:  # I: z's, x's and the norm's channels
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # x, B and C
        return self.inner + 2 * self.groups * self.state


def mamba2_form(mixer: nn.Module) -> Mamba2Form | None:
    """The sizes of `mixer` when it has a Mamba-2 mixer's layers, parameters and
    attributes in their shapes; else None."""
    names = ("num_heads", "head_dim", "n_groups", "ssm_state_size")
    heads, head_dim, groups, state = (getattr(mixer, n, None) for n in names)
    if not (
        isinstance(heads, int)
        and isinstance(head_dim, int)
        and isinstance(groups, int)
        and isinstance(state, int)
        and min(heads, head_dim, groups, state) > 0
    ):
        return None
    norm = getattr(mixer, "norm", None)
    form = Mamba2Form(heads, head_dim, groups, state, normed=not isinstance(norm, nn.Identity))
    in_proj, conv, out_proj = (getattr(mixer, n, None) for n in ("in_proj", "conv1d", "out_proj"))
    tables = [getattr(mixer, n, None) for n in ("A_log", "D", "dt_bias")]
    if not (
        isinstance(in_proj, nn.Linear)
        and isinstance(out_proj, nn.Linear)
        and isinstance(conv, nn.Conv1d)
        and all(isinstance(t, nn.Parameter) and tuple(t.shape) == (form.heads,) for t in tables)
        and form.heads % form.groups == 0
        and getattr(mixer, "intermediate_size", None) == form.inner
        and conv.groups == conv.in_channels == conv.out_channels == form.conv_dim
        and in_proj.out_features == form.inner + form.conv_dim + form.heads
        and out_proj.in_features == form.inner
        and (not form.normed or _group_norm(norm, form))
    ):
        return None
    return form


def _group_norm(norm: object, form: Mamba2Form) -> bool:
    """Whether `norm` is an RMS norm of the form's channels in its groups: their size in
    `group_size` (Mamba2's) or their count in `n_groups` (Falcon-H1's); or, with neither
    attribute, over all of them (Mamba2 of transformers 5.17 and earlier): every group
    keeps as many heads, so the kept fraction and the rescaling are those of each group.
    The proof on the example input decides."""
    weight = getattr(norm, "weight", None)
    group_size, n_groups = getattr(norm, "group_size", None), getattr(norm, "n_groups", None)
    return (
        isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (form.inner,)
        and (
            group_size == form.inner // form.groups
            or n_groups == form.groups
            or (group_size is None and n_groups is None)
        )
        and isinstance(getattr(norm, "variance_epsilon", None), float)
    )


@dataclass(frozen=True)
class Mamba2Parts:
    """A Mamba-2 mixer's layers, as the module docstring has them."""

    in_proj: nn.Linear
    conv1d: nn.Conv1d
    out_proj: nn.Linear
    # the model's own gated RMS norm (weight, variance_epsilon, group_size where it has
    # one), or an Identity where the mixer has none
    norm: Any


def parts_of(mixer: nn.Module) -> Mamba2Parts:
    """The layers of `mixer`, a Mamba-2 mixer (TypeError naming it if not)."""
    in_proj, conv, out_proj = (getattr(mixer, n, None) for n in ("in_proj", "conv1d", "out_proj"))
    if not (
        isinstance(in_proj, nn.Linear)
        and isinstance(conv, nn.Conv1d)
        and isinstance(out_proj, nn.Linear)
    ):
        raise TypeError(f"a {type(mixer).__name__} is not a Mamba-2 mixer of the known form")
    return Mamba2Parts(in_proj, conv, out_proj, getattr(mixer, "norm", None))


def in_proj_tables(mixer: nn.Module) -> list[str]:
    """The mixer's own buffers with an entry per in_proj output along their last
    dimension, cut with its rows (Falcon-H1's muP multipliers, `mup_vector`). (A
    parameter of that width is not cut: the proof then fails and the mixer stays whole.)"""
    width = parts_of(mixer).in_proj.out_features
    own = mixer.named_buffers(recurse=False)
    return [name for name, t in own if t is not None and t.dim() and t.shape[-1] == width]


@dataclass(eq=False, kw_only=True)
class Mamba2Group(ChannelGroup):
    """A Mamba-2 mixer's heads: `layer` is its in_proj, `rows` its conv1d (where the mask
    goes, on the x channels only)."""

    mixer: nn.Module
    form: Mamba2Form

    @property
    def segments(self) -> int:  # every group of heads keeps as many
        return self.form.groups

    @property
    def width(self) -> dict[nn.Module, int]:
        """Channels lost per head: in_proj its z and x rows and its dt row, conv1d its x
        channels, out_proj its columns."""
        p = self.form.head_dim
        return {self.layer: 2 * p + 1, self.rows: p, parts_of(self.mixer).out_proj: p}

    @property
    def cut_norms(self) -> list[tuple[nn.Module, int]]:
        """The norm over the heads' channels, cut with them: (norm, channels per head)."""
        return [(parts_of(self.mixer).norm, self.form.head_dim)] if self.form.normed else []

    @property
    def tables(self) -> list[tuple[nn.Module, str, int]]:
        """Per-head parameters, cut at export."""
        return [(self.mixer, name, 0) for name in ("A_log", "D", "dt_bias")]

    def unit_weights(self) -> torch.Tensor:
        """Per head: its z, x and dt rows of in_proj and its out_proj columns."""
        parts = parts_of(self.mixer)
        form, weight = self.form, parts.in_proj.weight.detach()
        h, inner = form.heads, form.inner
        z, x = weight[:inner].reshape(h, -1), weight[inner : 2 * inner].reshape(h, -1)
        dt = weight[inner + form.conv_dim :]
        out = parts.out_proj.weight.detach().t().reshape(h, -1)
        return torch.cat([z, x, dt, out], dim=1)

    def channels(self, units: torch.Tensor) -> torch.Tensor:
        return units

    def cut(self, mixer: nn.Module, keep: torch.Tensor) -> None:
        cut_heads(mixer, self.form, keep)


def head_channels(form: Mamba2Form, heads: torch.Tensor) -> torch.Tensor:
    """The channels (of z, x or the norm) of `heads`."""
    return (heads[:, None] * form.head_dim + torch.arange(form.head_dim)).flatten()


def cut_heads(mixer: nn.Module, form: Mamba2Form, keep: torch.Tensor) -> None:
    """Remove the heads not in `keep` (sorted; as many in each group) from a Mamba-2
    mixer, rescaling its norm (see the module docstring)."""
    multipliers = in_proj_tables(mixer)  # found while in_proj has all its rows
    keep = keep.cpu()
    channels = head_channels(form, keep)
    inner, shared = form.inner, torch.arange(form.inner, form.conv_dim)  # B and C stay
    conv_rows = torch.cat([channels, shared])
    in_rows = torch.cat([channels, inner + conv_rows, inner + form.conv_dim + keep])
    parts = parts_of(mixer)
    cut_linear(parts.in_proj, in_rows)
    cut_depthwise(parts.conv1d, conv_rows)
    cut_linear(parts.out_proj, channels, dim=1)
    norm = parts.norm
    for name in multipliers:
        table = getattr(mixer, name)
        setattr(mixer, name, table.index_select(-1, in_rows.to(table.device)))
    for name in ("A_log", "D", "dt_bias"):
        setattr(mixer, name, kept_rows(getattr(mixer, name), keep))
    if form.normed:
        ratio = form.heads / len(keep)  # N / K in every group
        weight = norm.weight.detach()[channels.to(norm.weight.device)]
        norm.weight = nn.Parameter((weight.float() * math.sqrt(ratio)).to(weight.dtype))
        norm.variance_epsilon *= ratio
        if isinstance(getattr(norm, "group_size", None), int):
            norm.group_size = len(channels) // form.groups
    sizes = {"num_heads": len(keep), "intermediate_size": len(channels)}
    if isinstance(getattr(mixer, "conv_dim", None), int):
        sizes["conv_dim"] = len(conv_rows)
    for name, size in sizes.items():
        setattr(mixer, name, size)


def zero_heads(mixer: nn.Module, form: Mamba2Form, drop: torch.Tensor) -> None:
    """What the hard mask does: the x channels of the heads `drop` zeroed in conv1d."""
    conv = parts_of(mixer).conv1d
    rows = head_channels(form, drop.cpu()).to(conv.weight.device)
    conv.weight[rows] = 0
    if conv.bias is not None:
        conv.bias[rows] = 0


def _balanced(form: Mamba2Form, slots: torch.Tensor) -> torch.Tensor:
    """Heads `slots` of every group (slot j: head j of each group), sorted."""
    per_group = form.heads // form.groups
    return (torch.arange(form.groups)[:, None] * per_group + slots.cpu()).flatten().sort().values


def _proven(mixer: nn.Module, form: Mamba2Form, call: tuple) -> bool:
    """Whether removing the same random half of the head slots in every group computes
    what zeroing them does, on the mixer's example call."""

    def zero(copy: nn.Module, keep: torch.Tensor) -> None:
        kept = set(_balanced(form, keep).tolist())
        drop = torch.tensor([h for h in range(form.heads) if h not in kept], dtype=torch.long)
        zero_heads(copy, form, drop)

    def cut(copy: nn.Module, keep: torch.Tensor) -> None:
        cut_heads(copy, form, _balanced(form, keep))

    return cuts_exactly(mixer, call, form.heads // form.groups, zero, cut)


def find_mamba2_groups(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple
) -> list[Mamba2Group]:
    """One group per Mamba-2 mixer of `model` with at least two heads per group of heads
    that runs on `inputs` and cuts exactly, none of whose layers is in `ignored`."""
    ignored_set = set(ignored)
    mixers = {
        name: (module, form)
        for name, module in model.named_modules()
        if (form := mamba2_form(module)) is not None
        and form.heads // form.groups > 1
        and module not in ignored_set
        and not set(module.children()) & ignored_set
    }
    if not mixers:
        return []
    calls = example_calls(model, [m for m, _ in mixers.values()], inputs)
    groups = []
    for name, (mixer, form) in mixers.items():
        if mixer not in calls or not _proven(mixer, form, calls[mixer]):
            continue
        in_proj, conv = mixer.in_proj, mixer.conv1d
        groups.append(
            Mamba2Group(
                name,
                in_proj,
                None,
                form.heads,
                [in_proj, conv],
                [mixer.out_proj],
                rows=conv,
                mixer=mixer,
                form=form,
            )
        )
    return groups


def check_mamba2_ratios(groups: list, ratios: dict[str, float], budget: str) -> None:
    """ValueError, before any mask, when a Mamba-2 mixer with several groups of heads is
    asked to lose heads under a budget other than "layer", or at a count its groups
    cannot keep alike."""
    for group in groups:
        if not isinstance(group, Mamba2Group) or ratios[group.name] == 0:
            continue
        segments = group.segments
        if segments == 1:
            continue
        if budget != "layer":
            raise ValueError(
                f"budget = {budget!r} cannot keep the same number of heads in each of the "
                f"{segments} groups of heads of Mamba-2 mixer {group.name!r}, which its norm "
                "needs; use budget='layer' or leave the mixer whole with a ratio of 0"
            )
        kept = kept_count(group.size, ratios[group.name])
        if kept % segments:
            per_group = group.size // segments
            allowed = [f"{1 - j / per_group:g}" for j in range(1, per_group)]
            raise ValueError(
                f"ratio {ratios[group.name]} keeps {kept} of the {group.size} heads of "
                f"Mamba-2 mixer {group.name!r}, which its {segments} groups of heads cannot "
                f"keep alike (each keeps as many, for its norm); ratios that can: {allowed}"
            )
