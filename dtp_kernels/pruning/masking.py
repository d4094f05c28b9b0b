"""Where DTP's masks live in a model: the mask source the pruner fills every forward,
the parametrizations that read it (rows of a conv or BN, or every weight), the BN fold
that multiplies every masked BN parameter at once, the hard-mask context, and stripping
the masks off a copy. The pruner (pruner.py) decides the masks; this module applies them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn.utils import parametrize


@dataclass
class FoldPlan:
    """Where the folded BN parameters, (weight, bias) pairs of one BN each, take their
    masks from: `channels` picks the pairs' channels from the flat mask (None: the pairs
    cover every segment in order); `halves` are the flat copy's pieces, every weight's
    size, then every bias's."""

    channels: torch.Tensor | None
    halves: list[int]

    @classmethod
    def build(cls, groups: list[int], sizes: list[int], device: torch.device) -> FoldPlan:
        """`groups[pair]` is the mask segment of each BN; `sizes` the segments' sizes."""
        halves = [sizes[g] for g in groups] * 2
        if groups == list(range(len(sizes))):
            return cls(None, halves)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        channels = [c for g in groups for c in range(offsets[g], offsets[g + 1])]
        return cls(torch.tensor(channels, device=device), halves)


def folded_products(mask: torch.Tensor, plan: FoldPlan, params: list[torch.Tensor]) -> list:
    """Every masked BN weight and bias (`params`, in (weight, bias) pairs) times its mask,
    at once on one flat copy of them (weights, then biases): four autograd ops whose
    backward runs in C++, where a product per parameter would allocate one tensor per BN
    parameter in forward and two in backward (on a GPU, host time the step pays in full).
    Returns views of one product tensor, in the order of `params`."""
    flat = torch.cat([*params[0::2], *params[1::2]]).view(2, -1)
    per_channel = mask if plan.channels is None else mask.index_select(0, plan.channels)
    products = (flat * per_channel.to(flat.dtype)).view(-1).split(plan.halves)
    half = len(products) // 2
    return [p for pair in zip(products[:half], products[half:], strict=True) for p in pair]


def refuse_no_grad_read(source: MaskSource, mask: torch.Tensor) -> None:
    """RuntimeError if masks that need gradients are read under torch.no_grad() within
    the model's forward: a reentrant activation checkpoint (or a no_grad block around
    pruned layers), where the scores would get no gradient from the forward and the
    recomputation would run the masks' backward once per checkpointed segment."""
    if source.in_forward and mask.requires_grad and not torch.is_grad_enabled():
        raise RuntimeError(
            "DTP's masks were read under torch.no_grad() in a forward that trains them: "
            "reentrant activation checkpointing (use_reentrant=True) or a no_grad block "
            "around pruned layers, where the pruner's scores cannot learn. Checkpoint "
            "with torch.utils.checkpoint(..., use_reentrant=False) (Hugging Face: "
            "activation_checkpointing_enable(activation_checkpointing_kwargs="
            "{'use_reentrant': False}))"
        )


def flat_mask(source: MaskSource) -> torch.Tensor:
    """The masks of this forward, all groups' in one tensor, checked by
    refuse_no_grad_read; RuntimeError when no forward of the pruned model set them."""
    if source.flat is None:
        raise RuntimeError(
            "the pruner's masks are read outside a forward of the pruned model (its "
            "forward pre-hook sets them): call the model, not one of its layers alone"
        )
    refuse_no_grad_read(source, source.flat)
    return source.flat


class MaskSource:
    """The masks of the current forward, shared by the parametrizations and hooks, and
    the BN parameters already multiplied by them (all at once; see
    DTPPruner._fold_masks). The flat mask is split per group only when a group's mask is
    read on its own (activation masks, parametrize's getter)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)
        self.flat: torch.Tensor | None = None
        self.in_forward = False  # between the model's forward pre-hook and forward hook
        self._split: tuple[torch.Tensor, ...] | None = None
        self.hard: list[torch.Tensor] | None = None  # set: evaluate the hard-masked model
        # per slot: the masked parameter, the original it was computed from, its version
        self.folded: list[torch.Tensor] | None = None
        self.folded_from: list[torch.Tensor] = []
        self.folded_versions: list[int] = []
        # per ScaleExperts: (the weight, its version, the masked weight) of this forward
        self.products: dict[nn.Module, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def set(self, flat: torch.Tensor) -> None:
        self.flat, self._split = flat, None
        self.drop_products()

    def set_folded(self, products: list[torch.Tensor], originals: list[torch.Tensor]) -> None:
        """This forward's masked BN parameters, one per slot, and what they came from."""
        self.folded, self.folded_from = products, originals
        self.folded_versions = [original._version for original in originals]

    @property
    def masks(self) -> tuple[torch.Tensor, ...]:
        if self._split is None:
            self._split = flat_mask(self).split(self.sizes)
        return self._split

    def get(self, index: int) -> torch.Tensor:
        return self.hard[index] if self.hard is not None else self.masks[index]

    def drop_products(self) -> None:
        """Forget the masked expert weights of this forward (a copy of every expert's
        projection, not to be held past the forward)."""
        if self.products:  # (no new dict per step for models without experts)
            self.products = {}

    def release_graph(self) -> None:
        """Keep the values, drop the autograd graph of this forward's masks, once its
        backward has run: held into the next step it would keep the scores' and BN
        parameters' gradient accumulators alive (stream mismatches under CUDA-graph
        capture)."""
        if self.flat is not None and self.flat.requires_grad:
            self.set(self.flat.detach())
            self.folded = None
        self.drop_products()


class ScaleRows(nn.Module):
    """Parametrization w -> w * mask over the output rows (dim 0), each mask entry
    repeated over `per_unit` consecutive rows (a GroupNorm's group; 1 for a channel), in
    each of `blocks` blocks of all the units (NesT's attention output: each channel of
    every head in turn)."""

    DIM = 0

    def __init__(self, source: MaskSource, index: int, per_unit: int = 1, blocks: int = 1) -> None:
        super().__init__()
        self.source, self.index, self.per_unit = source, index, per_unit
        # the view's leading dimension of blocks, none for one (as it was without them)
        self.blocks = (blocks,) if blocks > 1 else ()

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mask = self.source.get(self.index).to(weight.dtype)
        # view dim DIM as ([blocks,] units, per_unit) and broadcast the mask over it: no
        # repeated copy
        lead, rest = weight.shape[: self.DIM], weight.shape[self.DIM + 1 :]
        grouped = weight.view(*lead, *self.blocks, -1, self.per_unit, *rest)
        shape = [1] * grouped.dim()
        shape[self.DIM + len(self.blocks)] = -1
        return (grouped * mask.view(shape)).view_as(weight)


class ScaleLeadingRows(ScaleRows):
    """ScaleRows over the first `rows` rows, the others kept as they are (a Mamba-2
    conv1d: its heads' x channels, then the B and C channels all heads read)."""

    def __init__(self, source: MaskSource, index: int, per_unit: int, rows: int) -> None:
        super().__init__(source, index, per_unit)
        self.rows = rows

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(weight[: self.rows]), weight[self.rows :]])


class ScaleColumns(ScaleRows):
    """The same over a linear layer's input columns (dim 1): an attention unit's columns,
    or the features of a gated MLP."""

    DIM = 1


class ScaleDiagonalColumns(nn.Module):
    """Parametrization of a block-diagonal output projection (Projection.diagonal): unit
    u's `per_unit` columns times its mask in the rows of its own run only, by
    broadcasting over the weight viewed (runs, rows, units of a run, per_unit)."""

    def __init__(self, source: MaskSource, index: int, per_unit: int, runs: int) -> None:
        super().__init__()
        self.source, self.index, self.per_unit, self.runs = source, index, per_unit, runs

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mask = self.source.get(self.index).to(weight.dtype)
        blocks = weight.view(self.runs, weight.shape[0] // self.runs, -1, self.per_unit)
        return (blocks * mask.view(self.runs, 1, -1, 1)).view_as(weight)


class ScaleLast(ScaleRows):
    """Parametrization w -> w * mask over the last dimension, by broadcasting (a GRN's
    bias, of shape (C,) in timm and (1, 1, 1, C) in Hugging Face)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.source.get(self.index).to(weight.dtype)


class ScaleExperts(nn.Module):
    """Parametrization of an experts' down projection (the block's flat mask viewed as
    `shape`: experts first, the intermediate neurons along one dimension; a 2-D
    projection of the experts' matrices one after another, a row per neuron): each
    expert's neurons times the mask of its own group, the
    groups `first`, `first + 1`, ... of one expert each. The soft masks are read as one
    view of the flat mask: no copy per expert. An eager experts forward reads the weight
    once per expert it runs, so the product is made once per forward and read back while
    the weight is unchanged (not under torch.compile, which traces every read)."""

    def __init__(
        self, source: MaskSource, first: int, experts: int, shape: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.source, self.first, self.experts, self.shape = source, first, experts, shape
        self.offset = sum(source.sizes[:first])
        self.length = sum(source.sizes[first : first + experts])

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        source, last = self.source, self.first + self.experts
        reuse = source.hard is None and not torch.compiler.is_compiling()
        if reuse:
            made = source.products.get(self)
            if made is not None and made[0] is weight and made[1] == weight._version:
                return made[2]
        if source.hard is not None:
            mask = torch.stack(source.hard[self.first : last])
        else:
            mask = flat_mask(source).narrow(0, self.offset, self.length)
        product = weight * mask.to(weight.dtype).view(self.shape)
        if reuse:
            source.products[self] = (weight, weight._version, product)
        return product


def read_folded_first(module: nn.Module, name: str, source: MaskSource, slot: int) -> None:
    """Make reading ``module.<name>`` return the product DTPPruner folded for this forward
    while it is current (no hard masks, the original unchanged since), and parametrize's
    getter otherwise. Parametrize's getter costs several Python calls per read, 66 reads
    per ResNet-50 forward: a host cost an eager GPU step pays in full. The property goes on
    the class parametrize made for this module, which deep copies share: they read
    through parametrize, as does torch.compile (which traces parametrize, not a cache)."""
    cls = type(module)
    slow = getattr(cls, name)

    def get(self: nn.Module) -> torch.Tensor:
        if self is module and source.hard is None and not torch.compiler.is_compiling():
            # the fold's product while its original is unchanged (inline: 66 reads a step)
            folded = source.folded
            if (
                folded is not None
                and source.folded_from[slot]._version == source.folded_versions[slot]
            ):
                if not torch.is_grad_enabled():  # (one call per read: 66 a ResNet-50 step)
                    refuse_no_grad_read(source, folded[slot])
                return folded[slot]
        return slow.fget(self)

    setattr(cls, name, property(get, slow.fset))


class ScaleEach(nn.Module):
    """Parametrization w -> w * mask, one mask entry per weight (unstructured); with
    `blocked` the mask is in N:M block order (the weight's input dimension last)."""

    def __init__(self, source: MaskSource, index: int, blocked: bool = False) -> None:
        super().__init__()
        self.source, self.index, self.blocked = source, index, blocked

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mask = self.source.get(self.index).to(weight.dtype)
        if self.blocked:
            lead = weight.movedim(1, -1).shape
            return weight * mask.view(lead).movedim(-1, 1)
        return weight * mask.view_as(weight)


def is_mask(parametrization: nn.Module) -> bool:
    """Whether `parametrization` is one of this module's (a pruner's mask)."""
    return type(parametrization).__module__ == __name__


def parametrizations(module: nn.Module) -> MutableMapping[str, parametrize.ParametrizationList]:
    """A parametrized module's ModuleDict of parametrizations, by tensor name (its
    `parametrizations`, which mypy reads as `Tensor | Module`); {} when it has none."""
    if not parametrize.is_parametrized(module):
        return {}
    return cast(MutableMapping[str, parametrize.ParametrizationList], module.parametrizations)


def foreign_parametrizations(module: nn.Module) -> dict[str, list[str]]:
    """The tensors of `module` parametrized otherwise than by a pruner's mask (the
    user's weight norm), with the parametrizations' class names."""
    return {
        name: [type(p).__name__ for p in plist]
        for name, plist in parametrizations(module).items()
        if not all(is_mask(p) for p in plist)
    }


@contextlib.contextmanager
def keeping_grad_accumulators() -> Iterator[None]:
    """Register parametrizations without giving their parameters new gradient accumulators.

    ``register_parametrization`` sets the original parameter to itself (a no-op on its
    values) and autograd then gives it a new accumulator. DistributedDataParallel's
    hooks sit on the old one when the model was wrapped before the pruner was made (the
    Trainer's and Lightning's callbacks make it after): they never fire, and every rank
    would train its own masked weights. Inside this context that no-op is skipped."""
    setter = getattr(parametrize, "_maybe_set", None)
    if setter is None:  # a torch without it: the test of a wrapped model says so
        yield
        return

    def set_unless_same(dest, src) -> None:
        if dest is not src:
            setter(dest, src)

    parametrize._maybe_set = set_unless_same
    try:
        yield
    finally:
        parametrize._maybe_set = setter


def strip_parametrizations(module: nn.Module) -> None:
    """Put the original parameters back where masks parametrize them; the model's own
    parametrizations (a weight norm) stay. Unlike parametrize.remove_parametrizations
    this leaves the parametrized class alone, which deep copies share with the original:
    a module keeping some parametrizations gets a class of its own without the others."""
    lists = parametrizations(module)
    masked = [name for name, plist in lists.items() if all(is_mask(p) for p in plist)]
    mixed = [name for name, plist in lists.items() if any(is_mask(p) for p in plist)]
    if set(mixed) != set(masked):  # the pruner refuses such layers before any mask
        raise RuntimeError(f"masks on top of the model's own parametrizations of {mixed}")
    originals = {name: lists[name].original for name in masked}
    cls = module.__class__
    if len(masked) == len(lists):
        module.__class__ = cls.__bases__[0]
        del module._modules["parametrizations"]
    else:
        namespace = {k: v for k, v in vars(cls).items() if k not in masked}
        module.__class__ = type(cls.__name__, cls.__bases__, namespace)
        for name in masked:
            del lists[name]
    for name, parameter in originals.items():
        module._parameters[name] = cast(nn.Parameter, parameter)


class HardMasks:
    """Context manager: inside it the pruner's model runs with its hard 0/1 masks (what
    export() keeps) instead of the soft ones."""

    def __init__(self, pruner) -> None:
        self.pruner = pruner

    def __enter__(self):
        device = self.pruner.keep.device
        self.pruner._source.hard = [m.to(device) for m in self.pruner.hard_masks()]
        return self.pruner

    def __exit__(self, *exc) -> None:
        self.pruner._source.hard = None
