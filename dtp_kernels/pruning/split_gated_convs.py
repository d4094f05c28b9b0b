"""Gated convolution blocks whose hidden width is split unequally (MambaOut's
`GatedConvBlock`), pruned neuron by neuron.

Such a block widens its input with one linear layer `fc1` to twice its hidden width h,
splits that into the gate g (h channels) and the value, itself split into i channels
taken as they are and c channels through a depthwise conv (`split_indices` = (h, i, c)),
and reads `act(g) * cat(i, conv(c))` back with `fc2`:

    y = fc2(act(g) * cat(i, conv(c)))

Torch-Pruning's graph does not follow the unequal split, so these blocks are found by
their form. Hidden neuron j is gate row j and value row h + j of `fc1`, column j of
`fc2`, and for j >= i channel j - i of the conv. The mask goes on `fc2`'s columns (exact
whatever the gate computes); export keeps each kept neuron's rows, columns and conv
channel and writes the kept sizes into `split_indices`, the conv replaced by an identity
where none of its channels is kept. A block is adopted only when that is shown on a copy
on its example input (proof.py); the cost model counts the conv channels the mask's
removed neurons take, which depend on which neurons go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .cuts import cut_depthwise, cut_linear
from .mlps import FormMLPGroup
from .proof import cuts_exactly, dropped, example_calls


@dataclass
class SplitGatedConvGroup(FormMLPGroup):
    """The hidden neurons of a gated convolution block (`block`): `fc1` (two parts, the
    gate's rows and the value's) and the conv in `kept_out`, `fc2` in `kept_in`, the mask
    on `fc2`'s columns (`gated`)."""

    block: nn.Module | None = None

    def channels_lost(self, mask: torch.Tensor) -> dict[nn.Module, tuple[int, int]]:
        """(output, input) channels each layer loses under `mask`: fc1 two rows and fc2
        one column per removed neuron, the conv a channel per removed neuron past i."""
        parts = parts_of(self.block)
        _, values, _ = parts.split
        gone = (mask == 0).nonzero().flatten()
        convolved = int((gone >= values).sum())
        return {
            parts.fc1: (2 * len(gone), 0),
            parts.conv: (convolved, convolved),
            parts.fc2: (0, len(gone)),
        }


@dataclass(frozen=True)
class BlockParts:
    """A gated convolution block's layers and `split_indices`, as the module docstring
    has them."""

    fc1: nn.Linear
    conv: nn.Conv2d  # depthwise
    fc2: nn.Linear
    split: tuple[int, int, int]  # (hidden, taken as they are, convolved)


def _form(module: nn.Module) -> BlockParts | None:
    """`module`'s parts when it has the form of the module docstring, its sizes
    consistent; else None."""
    fc1, fc2, conv = (getattr(module, n, None) for n in ("fc1", "fc2", "conv"))
    split = getattr(module, "split_indices", None)
    if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
        return None
    if not (isinstance(conv, nn.Conv2d) and conv.groups == conv.in_channels == conv.out_channels):
        return None
    if not (isinstance(split, tuple) and len(split) == 3):
        return None
    hidden, values, convolved = split
    if not all(isinstance(n, int) for n in split):
        return None
    consistent = (
        fc1.out_features == 2 * hidden
        and values + convolved == hidden
        and conv.in_channels == convolved
        and fc2.in_features == hidden
        and hidden >= 2
    )
    return BlockParts(fc1, conv, fc2, (hidden, values, convolved)) if consistent else None


def parts_of(block: nn.Module | None) -> BlockParts:
    """The parts of `block`, a gated convolution block (TypeError naming it if not)."""
    parts = _form(block) if block is not None else None
    if parts is None:
        kind = type(block).__name__
        raise TypeError(f"a {kind} is not a gated convolution block (fc1, conv, fc2, split)")
    return parts


def cut_block(block: nn.Module, keep: torch.Tensor) -> None:
    """Keep the hidden neurons `keep` (sorted) of a gated convolution block, in place."""
    parts = parts_of(block)
    hidden, values, _ = parts.split
    keep = keep.to(parts.fc1.weight.device)
    cut_linear(parts.fc1, torch.cat([keep, hidden + keep]), 0)
    cut_linear(parts.fc2, keep, 1)
    convolved = keep[keep >= values] - values
    if len(convolved):
        cut_depthwise(parts.conv, convolved)
    else:  # no channel left to convolve: an identity on the empty part
        block.conv = nn.Identity()
    split = (len(keep), len(keep) - len(convolved), len(convolved))
    setattr(block, "split_indices", split)  # noqa: B010 (a tuple on a module typed as any)


def _proven(block: nn.Module, call: tuple[tuple, dict]) -> bool:
    """Whether `block` cuts exactly on its example call (proof.py)."""

    def zero(copy: nn.Module, keep: torch.Tensor) -> None:
        weight = parts_of(copy).fc2.weight
        weight[:, dropped(weight.shape[1], keep, weight.device)] = 0

    return cuts_exactly(block, call, parts_of(block).split[0], zero, cut_block)


def find_split_gated_convs(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple
) -> list[SplitGatedConvGroup]:
    """The gated convolution blocks of `model` that run on `inputs` and cut exactly, none
    of whose layers is in `ignored`, in model order."""
    names = {module: name for name, module in model.named_modules()}
    skipped = set(ignored)
    found = {m: parts for m in model.modules() if (parts := _form(m)) is not None}
    blocks = [m for m, p in found.items() if not {m, p.fc1, p.fc2, p.conv} & skipped]
    calls = example_calls(model, blocks, inputs)
    return [
        SplitGatedConvGroup(
            names[found[block].fc1],
            found[block].fc1,
            None,
            found[block].split[0],
            [found[block].fc1, found[block].conv],
            [found[block].fc2],
            gated=True,
            parts=2,
            block=block,
        )
        for block in blocks
        if block in calls and _proven(block, calls[block])
    ]


def prune_split_gated_conv(block: nn.Module, mask: torch.Tensor) -> None:
    """Cut the neurons whose hard mask is 0 from `block`, the exported copy's."""
    keep = mask.nonzero().flatten()
    if len(keep) < len(mask):
        cut_block(block, keep)
