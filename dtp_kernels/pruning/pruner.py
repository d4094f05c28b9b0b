"""DTPPruner: learned, exact-size filter pruning with Differentiable Transportation Pruning.

All scores live in one flat Parameter (views per group), initialised to the L2 norms of
the filters (paper, Sec. 4). In training mode every forward of the model first computes
all masks with one `transport_mask` call; `attach(optimizer)` commits the transport state
after every optimizer step. Masks go where they cost nothing (DESIGN.md section 2): on
the affine weight and bias of the group's BN, or on a conv's output rows and bias when no
BN follows; `mask_at="activation"` multiplies the activations with the fused epilogue
instead.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..masked_channel_epilogue import masked_channel_epilogue
from ..transport_mask import transport_mask
from ..transport_state import TransportState
from .base import ChannelPruner

MASK_AT = ("auto", "parameters", "activation")
EPILOGUE_BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")


class _FlopsModel:
    """The appendix's FLOPs as a function of the kept ratios alpha of the groups:
    sum over conv/linear layers of (K n_in alpha_in / groups + 1) n_out alpha_out A."""

    def __init__(self, model: nn.Module, groups: list, inputs: tuple) -> None:
        out_group, in_group = {}, {}
        for index, group in enumerate(groups):
            for module in group.kept_out:
                out_group[module] = index
            for module in group.kept_in:
                in_group[module] = index
        rows: list[tuple[float, float, int, int]] = []  # (in cost, out count, in idx, out idx)
        none = len(groups)  # index of the constant ratio 1

        def hook(module: nn.Module, _inputs, output: torch.Tensor) -> None:
            o = out_group.get(module, none)
            if isinstance(module, nn.Conv2d):
                area = output.shape[0] * output.shape[2] * output.shape[3]
                kernel = module.kernel_size[0] * module.kernel_size[1]
                depthwise = module.groups > 1 and module.groups == module.in_channels
                per_in = kernel if depthwise else kernel * module.in_channels / module.groups
                i = none if depthwise else in_group.get(module, none)
                rows.append((per_in, module.out_channels * area, i, o))
            else:
                count = output.numel() // module.out_features
                rows.append((module.in_features, module.out_features * count,
                             in_group.get(module, none), o))  # fmt: skip

        handles = [m.register_forward_hook(hook) for m in model.modules()
                   if isinstance(m, (nn.Conv2d, nn.Linear))]  # fmt: skip
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model(*inputs)
        finally:
            model.train(was_training)
            for h in handles:
                h.remove()
        self.per_in = torch.tensor([r[0] for r in rows], dtype=torch.float64)
        self.outs = torch.tensor([r[1] for r in rows], dtype=torch.float64)
        self.in_index = torch.tensor([r[2] for r in rows])
        self.out_index = torch.tensor([r[3] for r in rows])
        self.dense = float(((self.per_in + 1) * self.outs).sum())

    def ratio(self, alpha: torch.Tensor) -> torch.Tensor:
        if self.per_in.device != alpha.device:  # once: no host-to-device copies per step
            for name in ("per_in", "outs", "in_index", "out_index"):
                setattr(self, name, getattr(self, name).to(alpha.device))
        a = torch.cat([alpha.double(), alpha.new_ones(1, dtype=torch.float64)])
        flops = (self.per_in * a[self.in_index] + 1) * self.outs
        return (flops * a[self.out_index]).sum() / self.dense


@dataclass
class _FoldPlan:
    """Where the folded BN parameters, (weight, bias) pairs of one BN each, take their
    masks from: `channels` picks the pairs' channels from the flat mask (None: the pairs
    cover every segment in order); `halves` are the flat copy's pieces, every weight's
    size, then every bias's."""

    channels: torch.Tensor | None
    halves: list[int]

    @classmethod
    def build(cls, groups: list[int], sizes: list[int], device: torch.device) -> _FoldPlan:
        """`groups[pair]` is the mask segment of each BN; `sizes` the segments' sizes."""
        halves = [sizes[g] for g in groups] * 2
        if groups == list(range(len(sizes))):
            return cls(None, halves)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        channels = [c for g in groups for c in range(offsets[g], offsets[g + 1])]
        return cls(torch.tensor(channels, device=device), halves)


def _folded_products(mask: torch.Tensor, plan: _FoldPlan, params: list[torch.Tensor]) -> list:
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


class _MaskSource:
    """The masks of the current forward, shared by the parametrizations and hooks, and
    the BN parameters already multiplied by them (all at once; see
    DTPPruner._fold_masks). The flat mask is split per group only when a group's mask is
    read on its own (activation masks, parametrize's getter)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)
        self.flat: torch.Tensor | None = None
        self._split: tuple[torch.Tensor, ...] | None = None
        self.hard: list[torch.Tensor] | None = None  # set: evaluate the hard-masked model
        # slot -> (masked parameter, the original it was computed from, its version)
        self.folded: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def set(self, flat: torch.Tensor) -> None:
        self.flat, self._split = flat, None

    @property
    def masks(self) -> tuple[torch.Tensor, ...]:
        if self._split is None:
            self._split = self.flat.split(self.sizes)
        return self._split

    def get(self, index: int) -> torch.Tensor:
        return self.hard[index] if self.hard is not None else self.masks[index]

    def release_graph(self) -> None:
        """Keep the values, drop the autograd graph of this forward's masks: held past the
        forward it would keep the scores' and BN parameters' gradient accumulators alive
        into the next step (stream mismatches under CUDA-graph capture)."""
        if self.flat is not None and self.flat.requires_grad:
            self.set(self.flat.detach())
            self.folded = {}


class _ScaleRows(nn.Module):
    """Parametrization w -> w * mask, broadcast over the first (output-channel) dim."""

    def __init__(self, source: _MaskSource, index: int) -> None:
        super().__init__()
        self.source, self.index = source, index

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mask = self.source.get(self.index).to(weight.dtype)
        return weight * mask.view(-1, *([1] * (weight.dim() - 1)))


def _read_folded_first(module: nn.Module, name: str, source: _MaskSource, slot: int) -> None:
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
            cached = source.folded.get(slot)
            if cached is not None and cached[1]._version == cached[2]:
                return cached[0]
        return slow.fget(self)

    setattr(cls, name, property(get, slow.fset))


class _ScaleEach(nn.Module):
    """Parametrization w -> w * mask, one mask entry per weight (unstructured)."""

    def __init__(self, source: _MaskSource, index: int) -> None:
        super().__init__()
        self.source, self.index = source, index

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.source.get(self.index).to(weight.dtype).view_as(weight)


@dataclass
class LayerWeights:
    """An unstructured segment: every weight of one conv or linear layer."""

    name: str
    module: nn.Module
    size: int


class DTPPruner(ChannelPruner):
    """Prune `model` to exact sizes with DTP. See the module docstring and README.

    Args:
        model: the network; the pruner attaches masks to it (parametrizations/hooks).
        example_inputs: a tensor or tuple that runs through the model (batch 1 is enough).
        ratios: a float, {module name: ratio}, "[0, 0.5, 0.5, 0.5]" (per ResNet stage) or
            "[0:0, 1-15:0.5]" (per convolution index); each in [0, 1).
        budget: "layer" (one transport segment per group), "global" (one over all), or
            "flops": learned kept ratios sigmoid(theta) per group (started at 1 - ratio),
            the kept count k = n sigmoid(theta) differentiable through `keep`; add
            `pruner.penalty(target)` to the loss.
        granularity: "filter" (structured: channels, exported physically smaller) or
            "weight" (unstructured: one segment per conv/linear weight, scores |w|, the
            mask on the weights; exported with the pruned weights set to zero).
        eps, iters, backend: passed to `transport_mask`.
        mask_at: "auto" (parameters where possible), "parameters" or "activation".
        epilogue_backend: backend of `masked_channel_epilogue` for activation masks
            ("auto", "torch" for eager masking, "cpu", "triton", "cuda").
        ignored_layers: convolutions never to prune.
    """

    BUDGETS = ("layer", "global", "flops")
    NONFINITE_CHECK_EVERY = 100  # steps between reads of the skipped-step counts (0: never)

    def __init__(
        self,
        model: nn.Module,
        example_inputs: torch.Tensor | tuple,
        ratios: float | Mapping[str, float] | str,
        *,
        budget: str = "layer",
        granularity: str = "filter",
        eps: float = 1.0,
        iters: int = 1,
        mask_at: str = "auto",
        ignored_layers: Sequence[nn.Module] = (),
        backend: str = "auto",
        epilogue_backend: str = "auto",
    ) -> None:
        if granularity not in ("filter", "weight"):
            raise ValueError(f"granularity = {granularity!r}; allowed: ['filter', 'weight']")
        if granularity == "weight" and budget == "flops":
            raise ValueError("budget='flops' needs granularity='filter'")
        self.granularity = granularity
        if mask_at not in MASK_AT:
            raise ValueError(f"mask_at = {mask_at!r}; allowed: {list(MASK_AT)}")
        if epilogue_backend not in EPILOGUE_BACKENDS:
            raise ValueError(
                f"epilogue_backend = {epilogue_backend!r}; allowed: {list(EPILOGUE_BACKENDS)}"
            )
        self.epilogue_backend = epilogue_backend
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"eps = {eps!r}; it must be a number > 0")
        super().__init__(
            model, example_inputs, ratios, budget=budget, ignored_layers=ignored_layers
        )
        self.eps, self.iters, self.backend, self.mask_at = float(eps), iters, backend, mask_at
        device = next(model.parameters()).device
        if budget == "flops":  # learned kept ratios, started at the ratios' kept fractions
            alpha = torch.tensor([k / n for k, n in zip(self.kept, self.sizes, strict=True)])
            self.theta = nn.Parameter(torch.logit(alpha.clamp(1e-4, 1 - 1e-4)).to(device))
            self._flops = _FlopsModel(model, self.groups, self.example_inputs)
        if granularity == "filter":  # L2 norms of the filters (paper, Sec. 4)
            initial = [g.conv.weight.detach().flatten(1).norm(dim=1) for g in self.groups]
        else:  # |w| of every weight
            initial = [g.module.weight.detach().abs().flatten() for g in self.groups]
        self.scores = nn.Parameter(torch.cat(initial).float().to(device))
        segments = [sum(self.sizes)] if budget == "global" else self.sizes
        self.state = TransportState(segments, device=device)
        self._steps_since_check, self._skipped_seen = 0, [0] * len(segments)
        self.register_buffer("keep", torch.tensor(self.kept, dtype=torch.float32, device=device))
        self.register_buffer("_sizes", torch.tensor(self.sizes, dtype=torch.float32, device=device))
        self._source = _MaskSource(self.sizes)
        self._fold: list[tuple[int, nn.Parameter]] = []  # (group, BN parameter) per slot
        self._fold_plan: _FoldPlan | None = None
        with torch.no_grad():  # masks exist before the first forward (parametrize checks)
            self._compute_masks(model, ())
        self._handles = [
            model.register_forward_pre_hook(self._compute_masks),
            model.register_forward_hook(lambda *_: self._source.release_graph()),
        ]
        for index, group in enumerate(self.groups):
            self._attach_mask(index, group)

    def _find_groups(self, model: nn.Module, inputs: tuple, ignored: list) -> list:
        if self.granularity == "filter":
            return super()._find_groups(model, inputs, ignored)
        return [
            LayerWeights(name, module, module.weight.numel())
            for name, module in model.named_modules()
            if isinstance(module, (nn.Conv2d, nn.Linear)) and module not in ignored
        ]

    def _attach_mask(self, index: int, group) -> None:
        if self.granularity == "weight":
            parametrize.register_parametrization(
                group.module, "weight", _ScaleEach(self._source, index)
            )
            return
        if self.mask_at != "activation" and group.bn is not None and group.bn.affine:
            for name in ("weight", "bias"):
                slot = len(self._fold)
                scale = _ScaleRows(self._source, index)
                parametrize.register_parametrization(group.bn, name, scale)
                _read_folded_first(group.bn, name, self._source, slot)
                self._fold.append((index, group.bn.parametrizations[name].original))
        elif self.mask_at != "activation" and group.bn is None:
            for name in ("weight", "bias") if group.conv.bias is not None else ("weight",):
                parametrize.register_parametrization(
                    group.conv, name, _ScaleRows(self._source, index)
                )
        else:  # on the activations, with the fused epilogue
            target = group.bn if group.bn is not None else group.conv

            def hook(_module, _inputs, output, index=index):
                mask = self._source.get(index)
                return masked_channel_epilogue(
                    output, mask.to(output.dtype), backend=self.epilogue_backend
                )

            self._handles.append(target.register_forward_hook(hook))

    def current_keep(self) -> torch.Tensor:
        """k per segment: fixed counts, or n sigmoid(theta) under budget='flops'."""
        if self.budget == "flops":
            return torch.sigmoid(self.theta) * self._sizes
        return self.keep

    def kept_counts(self) -> list[int]:
        if self.budget != "flops":
            return self.kept
        keep = self.current_keep().detach().round().long().cpu().tolist()
        return [min(n, max(1, k)) for k, n in zip(keep, self.sizes, strict=True)]

    def flops_ratio(self) -> torch.Tensor:
        """F(alpha) of the appendix: the FLOPs kept at the learned ratios over the dense
        FLOPs, differentiable in theta (budget='flops' only)."""
        if self.budget != "flops":
            raise ValueError("flops_ratio() and penalty() need budget='flops'")
        return self._flops.ratio(torch.sigmoid(self.theta))

    def penalty(self, target: float) -> torch.Tensor:
        """||F - B||^2 for a FLOPs budget B in (0, 1] (the fraction of dense FLOPs kept)."""
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
            raise ValueError(f"target = {target!r}; the FLOPs budget must be in (0, 1]")
        return (self.flops_ratio() - target) ** 2

    def _compute_masks(self, model: nn.Module, _inputs) -> None:
        """Forward pre-hook: all masks in one transport_mask call.

        NaN/Inf scores would make their group's mask NaN and so every activation and
        gradient of the network; they enter as the neutral score 0.5 instead (no pull
        either way, no gradient), and their segment's state is held at this step and the
        step counted in ``skipped_steps``. The transport kernels do all of it on the
        device (nonfinite="neutral").
        """
        mask = self._transport(update=model.training and torch.is_grad_enabled())
        self._source.set(mask)
        self._fold_masks()

    def _fold_masks(self) -> None:
        """Multiply every masked BN weight and bias by its mask at once (_folded_products)
        instead of one multiply per parameter per forward: ResNet-50 has 66 of them, and
        an eager GPU step pays host time per op and per allocation."""
        if not self._fold:
            return
        originals = [original for _, original in self._fold]
        flat = self._source.flat
        if self._fold_plan is None or (
            self._fold_plan.channels is not None and self._fold_plan.channels.device != flat.device
        ):
            self._fold_plan = _FoldPlan.build(
                [index for index, _ in self._fold[0::2]], self.sizes, flat.device
            )
        products = _folded_products(flat, self._fold_plan, originals)
        self._source.folded = {
            slot: (product, original, original._version)
            for slot, (product, original) in enumerate(zip(products, originals, strict=True))
        }

    def _transport(self, update: bool) -> torch.Tensor:
        """The soft masks of all groups, NaN/Inf scores read as the neutral 0.5."""
        return transport_mask(
            self.scores, self.current_keep(), self.state, eps=self.eps, iters=self.iters,
            update=update, backend=self.backend, nonfinite="neutral",
        )  # fmt: skip

    def channel_scores(self) -> torch.Tensor:
        """The current soft masks (update=False): the top-k of each group is kept."""
        with torch.no_grad():
            mask = self._transport(update=False)
            scores = self.scores.nan_to_num(0.5, 0.5, 0.5)
        return mask + 1e-12 * scores  # ties (masks at 0 or 1) by score

    def attach(self, optimizer: torch.optim.Optimizer):
        """Commit the transport state after every `optimizer.step()`; returns the handle.

        Every NONFINITE_CHECK_EVERY steps it also reads the skipped-step counts (the only
        host read of a DTP step) and warns, at most once per check, when a group skipped
        steps since the last check because its scores were NaN or Inf.
        """

        def after_step(*_) -> None:
            self.state.commit()
            self._steps_since_check += 1
            if self.NONFINITE_CHECK_EVERY and (
                self._steps_since_check >= self.NONFINITE_CHECK_EVERY
            ):
                self._steps_since_check = 0
                self._warn_skipped()

        return optimizer.register_step_post_hook(after_step)

    def _warn_skipped(self) -> None:
        counts = self.state.skipped_steps.tolist()
        new = [c - last for c, last in zip(counts, self._skipped_seen, strict=True)]
        self._skipped_seen = counts
        if any(new):
            groups = [(name, n) for name, n in zip(self._segment_names(), new, strict=True) if n]
            warnings.warn(
                "DTP: non-finite (NaN/Inf) scores made these groups skip steps since the last "
                f"check (their transport state was kept): {groups}; pruner.report() has the "
                "totals",
                RuntimeWarning,
                stacklevel=2,
            )

    def _segment_names(self) -> list[str]:
        return ["all groups (global)"] if self.budget == "global" else [g.name for g in self.groups]

    def skipped_steps(self) -> list[int]:
        """Per group: committed steps its transport state skipped for NaN/Inf scores."""
        counts = self.state.skipped_steps.tolist()
        return [counts[0]] * len(self.groups) if self.budget == "global" else counts

    def hard_masked(self) -> _HardMasks:
        """Context manager: inside it the model runs with the hard 0/1 masks."""
        return _HardMasks(self)

    def report(self) -> dict:
        """Base report plus, per group, the soft-mask mass inside the top k and the mean
        squared distance of the soft mask from the hard one."""
        result = super().report()
        with torch.no_grad():
            soft = self._transport(update=False).float().cpu()
        hard = torch.cat(self.hard_masks())
        for row, skipped in zip(result["groups"], self.skipped_steps(), strict=True):
            row["skipped_steps"] = skipped
        for row, s, h in zip(result["groups"], soft.split(self.sizes), hard.split(self.sizes),
                             strict=True):  # fmt: skip
            row["mass_in_top_k"] = float((s * h).sum() / h.sum().clamp(min=1))
            row["distance_to_hard"] = float(((s - h) ** 2).mean())
        return result

    def predicted_counts(self, masks: list[torch.Tensor] | None = None) -> tuple[int, int]:
        if self.granularity == "filter":
            return super().predicted_counts(masks)
        masks = self.hard_masks() if masks is None else masks
        pruned = sum(int(m.numel() - m.sum()) for m in masks)
        return self._base_params - pruned, self._base_flops  # zeros still run densely

    def export(self) -> nn.Module:
        """Filter granularity: the physically smaller network (see ChannelPruner.export).
        Weight granularity: a copy whose pruned weights are zero (same shapes)."""
        if self.granularity == "filter":
            return super().export()
        pruned = self._unmasked_copy()
        modules = dict(pruned.named_modules())
        with torch.no_grad():
            for group, mask in zip(self.groups, self.hard_masks(), strict=True):
                weight = modules[group.name].weight
                weight.mul_(mask.to(weight.device, weight.dtype).view_as(weight))
        return pruned

    def _unmasked_copy(self) -> nn.Module:
        """A deep copy of the model without this pruner's masks, hooks and state."""
        memo = {id(self): self, id(self._source): _MaskSource(self.sizes)}  # do not copy these
        pruned = copy.deepcopy(self.model, memo)
        for module in list(pruned.modules()):
            for handle in self._handles:
                module._forward_pre_hooks.pop(handle.id, None)
                module._forward_hooks.pop(handle.id, None)
            if parametrize.is_parametrized(module):
                _strip_parametrizations(module)
        return pruned

    def remove(self) -> None:
        """Detach the pruner from the model: hooks and parametrizations are removed and the
        unmasked weights restored."""
        for handle in self._handles:
            handle.remove()
        for module in list(self.model.modules()):
            if parametrize.is_parametrized(module):
                _strip_parametrizations(module)


def _strip_parametrizations(module: nn.Module) -> None:
    """Put the original parameters back. Unlike parametrize.remove_parametrizations this
    leaves the parametrized class alone, which deep copies share with the original."""
    originals = {name: plist.original for name, plist in module.parametrizations.items()}
    module.__class__ = module.__class__.__bases__[0]
    del module._modules["parametrizations"]
    for name, parameter in originals.items():
        module._parameters[name] = parameter


class _HardMasks:
    def __init__(self, pruner: DTPPruner) -> None:
        self.pruner = pruner

    def __enter__(self) -> DTPPruner:
        device = self.pruner.scores.device
        self.pruner._source.hard = [m.to(device) for m in self.pruner.hard_masks()]
        return self.pruner

    def __exit__(self, *exc) -> None:
        self.pruner._source.hard = None
