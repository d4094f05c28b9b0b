"""DTPPruner: learned, exact-size pruning of filters, neurons and attention heads with
Differentiable Transportation Pruning.

All scores live in one flat Parameter (views per group), initialised to the L2 norms of
the filters (paper, Sec. 4). In training mode every forward of the model first computes
all masks with one `transport_mask` call; `attach(optimizer)` commits the transport state
after every optimizer step. Masks go where they cost nothing (docs/design.md section 2): on
the affine weight and bias of the group's BN, or on a conv's output rows and bias when no
BN follows; `mask_at="activation"` multiplies the activations with the fused epilogue
instead. Attention heads and gated MLPs take theirs on the consuming projection's input
columns, the experts of a mixture-of-experts block on each expert's down-projection
columns, GroupNorm groups on the norm's rows.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from .._extension import _C, compiled
from ..masked_channel_epilogue import masked_channel_epilogue
from ..transport_mask import transport_mask
from ..transport_state import TransportState
from . import nm as nm_rules
from .base import ChannelPruner, ExportMismatchError, _sharded_parameters, is_sharded
from .channel_graph import output_tensors
from .checkpoint_keys import name_weights_unmasked
from .conv1d import linear_to_conv1d
from .cost import FlopsRatio
from .example_inputs import call_model, in_float32, on_model_device
from .experts import ExpertGroup, owner_and_name, tied_units
from .export_blame import TRIAL_EXPORTS, culprit_groups
from .groups import out_width
from .heads import HeadGroup
from .mamba import MambaGroup
from .mamba2 import Mamba2Group
from .masking import (
    FoldPlan,
    HardMasks,
    MaskSource,
    ScaleColumns,
    ScaleDiagonalColumns,
    ScaleEach,
    ScaleExperts,
    ScaleLast,
    ScaleLeadingRows,
    ScaleRows,
    folded_products,
    keeping_grad_accumulators,
    read_folded_first,
    strip_parametrizations,
)
from .precision import HALF, float32_weights, ieee_fp32
from .proof import FP32_TOLERANCE, TOLERANCES, close
from .ratios import Ratios
from .refusals import zero_ratios
from .sharded_export import export_sharded
from .whole_experts import MaskedRouting, WholeExpertsGroup, mask_router, unmask_router

MASK_AT = ("auto", "parameters", "activation")
GRANULARITIES = ("filter", "weight", "n:m")
SCORE_SOURCES = ("learned", "magnitude")
# the layers granularity="weight" and "n:m" mask: weights laid out [out, in, ...]
WEIGHT_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
EPILOGUE_BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")


@dataclass
class LayerWeights:
    """An unstructured segment: every weight of one conv or linear layer."""

    name: str
    layer: nn.Module
    size: int
    # zeroed weights export exactly as they were masked, whatever follows the layer
    norms: tuple = ()


def parameter_slot(model: nn.Module) -> tuple[nn.Module, str] | None:
    """The module and key holding `model`'s first parameter (None without one): read
    there at each forward, it has the device model.to() gave it (a conversion may
    replace the tensor)."""
    name = next((name for name, _ in model.named_parameters()), None)
    if name is None:
        return None
    prefix, _, key = name.rpartition(".")
    return model.get_submodule(prefix), key


def distributed() -> bool:
    """Whether a torch.distributed process group of several ranks is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepHooks:
    """The optimizer hooks DTPPruner.attach() registers, removed together."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class DTPPruner(ChannelPruner):
    """Prune `model` to exact sizes with DTP. See the module docstring and README.

    Args:
        model: the network; the pruner attaches masks to it (parametrizations/hooks).
        example_inputs: what runs through the model (batch 1 is enough): a tensor, a
            tuple of positional arguments or a dict of keyword arguments (a Hugging Face
            processor's output: input ids with pixel values).
        ratios: a float; a dict of module names, fnmatch patterns or kinds of group
            ("channels", "mlp", "heads", "experts", "coupled") to ratios; a list of one
            ratio per ResNet stage ([0, 0.5, 0.5, 0.5]); or the paper's strings,
            "[0, 0.5, 0.5, 0.5]" (per stage) or "[0:0, 1-15:0.5]" (per convolution
            index); each in [0, 1).
        budget: "layer" (one transport segment per group, or per group of experts under
            group-limited routing), "global" (one over all), or
            "flops": learned kept ratios sigmoid(theta) per group (started at 1 - ratio;
            the experts of a block share one), the kept count k = n sigmoid(theta)
            differentiable through `keep`; add
            `pruner.penalty(target)` to the loss.
        granularity: "filter" (structured: channels, exported physically smaller),
            "weight" (unstructured: one segment per conv/linear weight, scores from |w|
            (see `scores`), the mask on the weights; exported with the pruned weights
            set to zero) or "n:m" (every block of M consecutive weights along a layer's
            input dimension keeps exactly N, one segment per block; scores from |w|;
            exported with zeros). Under "n:m" each pruned layer's ratio must be 1 - N/M
            (or 0 to leave it whole).
        nm: (N, M) of granularity="n:m", 1 <= N < M, M in (4, 8, 16); default (2, 4).
        scores: "learned" (default): the scores are the pruner's own parameter
            (`pruner.scores`), initialised to the filters' L2 norms or the weights'
            magnitudes, and trained by the optimizer; "magnitude" (granularity "weight"
            or "n:m" only): every forward's scores are the current |w|, as the paper
            scores weights, so the mask's gradient reaches the weights themselves and the
            pruner keeps no score parameter, gradient or optimizer state (8 bytes per
            weight less with SGD and momentum, 12 with Adam, |w| saved for the backward
            counted; `benchmarks/dtp_memory.py`).
        eps, iters, backend: passed to `transport_mask`.
        mask_at: "auto" (parameters where possible), "parameters" or "activation".
        epilogue_backend: backend of `masked_channel_epilogue` for activation masks
            ("auto", "torch" for eager masking, "cpu", "triton", "cuda").
        ignored_layers: layers (convolutions, linear layers, attention modules, or
            modules holding them) never to prune, as modules of the model or their names.
        prune_coupled: also prune the channel widths that residual adds couple (kind
            "coupled"), one segment per width, masked at every producer's BN (or its
            rows); widths that meet a concatenation, a LayerNorm, an added parameter or a
            depthwise conv are left whole.
    """

    # parameters and buffers (nn.Module's attributes read as `Tensor | Module` otherwise)
    scores: nn.Parameter | None
    theta: nn.Parameter
    keep: torch.Tensor
    _sizes: torch.Tensor
    _tie: torch.Tensor | None

    BUDGETS = ("layer", "global", "flops")
    _trial_masks: list[torch.Tensor] | None = None  # set only during export_blame's trials
    NONFINITE_CHECK_EVERY = 100  # steps between reads of the skipped-step counts (0: never)

    def __init__(
        self,
        model: nn.Module,
        example_inputs: torch.Tensor | tuple | Mapping,
        ratios: Ratios,
        *,
        budget: str = "layer",
        granularity: str = "filter",
        nm: tuple[int, int] = (2, 4),
        scores: str = "learned",
        eps: float = 1.0,
        iters: int = 1,
        mask_at: str = "auto",
        ignored_layers: Sequence[nn.Module | str] = (),
        backend: str = "auto",
        epilogue_backend: str = "auto",
        prune_coupled: bool = False,
    ) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity = {granularity!r}; allowed: {list(GRANULARITIES)}")
        if granularity == "weight" and budget == "flops":
            raise ValueError("budget='flops' needs granularity='filter'")
        if granularity == "n:m" and budget != "layer":
            raise ValueError(
                "granularity='n:m' keeps N of every block of M: budget must be 'layer', "
                f"got {budget!r}"
            )
        if scores not in SCORE_SOURCES:
            raise ValueError(f"scores = {scores!r}; allowed: {list(SCORE_SOURCES)}")
        if scores == "magnitude" and granularity == "filter":
            raise ValueError(
                "scores = 'magnitude' scores each weight by |w|: it needs granularity "
                "'weight' or 'n:m', got granularity = 'filter' (filter scores are learned, "
                "initialised to the filters' L2 norms)"
            )
        self.granularity = granularity
        self.nm = nm_rules.check_nm(nm) if granularity == "n:m" else None
        if mask_at not in MASK_AT:
            raise ValueError(f"mask_at = {mask_at!r}; allowed: {list(MASK_AT)}")
        if epilogue_backend not in EPILOGUE_BACKENDS:
            raise ValueError(
                f"epilogue_backend = {epilogue_backend!r}; allowed: {list(EPILOGUE_BACKENDS)}"
            )
        self.epilogue_backend = epilogue_backend
        if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and 0 < eps < math.inf):
            raise ValueError(f"eps = {eps!r}; it must be a finite number > 0")
        if isinstance(ignored_layers, Iterable) and not isinstance(
            ignored_layers, (str, nn.Module)
        ):
            ignored_layers = list(ignored_layers)  # read twice: a generator only once
        super().__init__(
            model,
            example_inputs,
            ratios,
            budget=budget,
            ignored_layers=ignored_layers,
            prune_coupled=prune_coupled,
        )
        self.eps, self.iters, self.backend, self.mask_at = float(eps), iters, backend, mask_at
        names = {module: name for name, module in model.named_modules()}
        self._ignored_names = [names.get(m, m) for m in ignored_layers]  # (made_with)
        if self.nm is not None:
            self._check_nm_groups(self.nm)
        device = next(model.parameters()).device
        self._device_witness = parameter_slot(model)
        if budget == "flops":  # learned kept ratios, started at the ratios' kept fractions
            alpha = torch.tensor([k / n for k, n in zip(self.kept, self.sizes, strict=True)])
            tie = tied_units(self.groups)  # a block's experts learn one ratio
            if tie is not None:
                first = {unit: index for index, unit in reversed(list(enumerate(tie)))}
                alpha = alpha[[first[unit] for unit in range(len(first))]]
            self.register_buffer("_tie", None if tie is None else torch.tensor(tie, device=device))
            self.theta = nn.Parameter(torch.logit(alpha.clamp(1e-4, 1 - 1e-4)).to(device))
            self._flops = FlopsRatio(self._layers, self.groups)
        if scores == "magnitude":  # no parameter: _scores() reads |w| every forward
            self.scores = None
        else:
            if granularity == "filter":  # L2 norms of the filters (paper, Sec. 4)
                initial = torch.cat([g.unit_weights().norm(dim=1) for g in self.groups])
            else:  # |w| of every weight (block by block under n:m)
                initial = self._magnitudes([g.layer.weight.detach() for g in self.groups])
            self.scores = nn.Parameter(initial.float().to(device))
        kept: Sequence[float]
        if self.nm is not None:  # one segment per block of M, keeping N
            n, m = self.nm
            # N held once and read by every block (current_keep): not 4 bytes per block
            segments, kept = [m] * (sum(self.sizes) // m), [float(n)]
        elif budget == "global":
            segments, kept = [sum(self.sizes)], self.kept
        else:  # a group's equal segments (group-limited routing) share its count
            parts = self._segments_per_group()
            segments = [n // s for n, s in zip(self.sizes, parts, strict=True) for _ in range(s)]
            kept = [k // s for k, s in zip(self.kept, parts, strict=True) for _ in range(s)]
        self.state = TransportState(segments, device=device)
        self._steps_since_check, self._skipped_seen = 0, [0] * len(self.groups)
        self.register_buffer("keep", torch.tensor(kept, dtype=torch.float32, device=device))
        self._keep_view: torch.Tensor | None = None  # N:M: keep expand()ed over the blocks
        self.register_buffer("_sizes", torch.tensor(self.sizes, dtype=torch.float32, device=device))
        self._source = MaskSource(self.sizes)
        # per slot: (group, the BN parameter's parametrization list); its parameter
        self._fold: list[tuple[int, parametrize.ParametrizationList]] = []
        self._fold_originals: list[torch.Tensor] = []
        self._fold_sharded = False  # FSDP2 shards them: each BN reads its own, unsharded
        self._fold_plan: FoldPlan | None = None
        with torch.no_grad():  # masks exist before the first forward (parametrize checks)
            self._compute_masks(model, ())
        self._source.in_forward = False
        # The forward's masks keep their autograd graph until the optimizer step (attach):
        # activation checkpointing recomputes layers in the backward and must read the
        # very masks the forward read. Masked expert weights made once per forward go at
        # its end: a recomputation makes them again, as the forward did.
        self._handles = [
            model.register_forward_pre_hook(self._compute_masks),
            # eager even under torch.compile: a frame of its own there (guards, a graph
            # call) costs more than the check it runs
            model.register_forward_hook(torch.compiler.disable(self._forward_done)),
            # load_state_dict(assign=True) puts new parameter tensors in the BNs
            model.register_load_state_dict_post_hook(self._refresh_fold),
        ]
        try:
            with keeping_grad_accumulators():  # DDP's hooks on the masked weights stay live
                for index, group in enumerate(self.groups):  # a tie set's read its first's
                    self._attach_mask(self.mask_of[index], group)
            self._refresh_fold()
        except BaseException:
            self.remove()  # the model as it was given, not half masked
            raise

    def made_with(self) -> dict:
        """The keyword arguments that make a pruner as this one was made (the model left
        out; ignored layers by name), for the same architecture built again
        (export_sharded)."""
        return dict(
            example_inputs=self.example_inputs,
            ratios=self._asked_ratios,
            budget=self.budget,
            granularity=self.granularity,
            nm=self.nm or (2, 4),
            scores="magnitude" if self.scores is None else "learned",
            eps=self.eps,
            iters=self.iters,
            mask_at=self.mask_at,
            ignored_layers=self._ignored_names,
            backend=self.backend,
            epilogue_backend=self.epilogue_backend,
            prune_coupled=self.prune_coupled,
        )

    def _forward_done(self, *_) -> None:
        self._source.in_forward = False
        self._source.drop_products()

    def _check_nm_groups(self, nm: tuple[int, int]) -> None:
        """Every layer N:M prunes has an input dimension divisible by M and the ratio
        1 - N/M (N:M fixes it); else ValueError naming the layers, before any mask."""
        n, m = nm
        nm_rules.check_layers({g.name: g.layer for g in self.groups}, m)
        wrong = {name: r for name, r in self.ratios.items() if abs(r - (1 - n / m)) > 1e-9}
        if wrong:
            raise ValueError(
                f"granularity='n:m' with nm = {(n, m)} prunes {1 - n / m} of every layer; "
                f"these layers have other ratios: {wrong}; give 0 (whole) or {1 - n / m}"
            )

    def _find_groups(self, model: nn.Module, inputs: tuple, ignored: list) -> list:
        if self.granularity == "filter":
            return super()._find_groups(model, inputs, ignored)
        owners: dict[torch.Tensor, list[str]] = {}
        for name, module in model.named_modules():
            for parameter in module.parameters(recurse=False):
                owners.setdefault(parameter, []).append(name)
        layers = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, WEIGHT_LAYERS) and module not in ignored
        ]
        # a weight tied to another module's (an output layer's to the embedding) would be
        # masked in one of its uses and exported zero in both: left whole
        tied = {
            name: [other for other in owners[module.weight] if other != name]
            for name, module in layers
            if len(owners[module.weight]) > 1
        }
        for name in tied:
            self._whole_reasons[model.get_submodule(name)] = (
                f"its weight is tied to {tied[name]}'s: a mask would reach one use of it"
            )
        if tied:
            warnings.warn(
                f"the weights of {list(tied)} are tied to other modules' (layer: those "
                f"modules, {tied}): a mask would reach one use of them, so they are left "
                "whole",
                UserWarning,
                stacklevel=3,
            )
        return [
            LayerWeights(name, module, module.weight.numel())
            for name, module in layers
            if name not in tied
        ]

    def _attach_mask(self, index: int, group) -> None:
        scale: nn.Module  # the parametrization that masks a tensor
        if self.granularity != "filter":
            scale = ScaleEach(self._source, index, blocked=self.nm is not None)
            parametrize.register_parametrization(group.layer, "weight", scale)
            return
        if isinstance(group, ExpertGroup):  # the down projection's columns, per expert
            if group.expert == 0:  # one parametrization for the block's experts
                layout = group.layout
                scale = ScaleExperts(self._source, index, layout.experts, layout.mask_shape())
                owner, name = owner_and_name(group.experts, layout.down)
                parametrize.register_parametrization(owner, name, scale)
            return
        if isinstance(group, WholeExpertsGroup):  # log(mask) on the router's logits
            mask_router(group.router, self._source, index, group.size)
            return
        if isinstance(group, Mamba2Group):  # conv1d's x rows, per head; B and C stay
            conv, inner = group.rows, group.form.inner
            for name in ("weight", "bias") if conv.bias is not None else ("weight",):
                scale = ScaleLeadingRows(self._source, index, group.form.head_dim, inner)
                parametrize.register_parametrization(conv, name, scale)
            return
        if isinstance(group, MambaGroup):  # conv1d's rows: fused kernels read its weight
            for name in ("weight", "bias") if group.rows.bias is not None else ("weight",):
                scale = ScaleRows(self._source, index)
                parametrize.register_parametrization(group.rows, name, scale)
            return
        if isinstance(group, HeadGroup):  # the output projection's columns, per unit
            for layer in group.members:  # every layer of a chain tied by its bias
                out = layer.out
                if out.diagonal > 1:  # each unit's columns in its own run's rows
                    scale = ScaleDiagonalColumns(self._source, index, out.per_unit, out.diagonal)
                else:
                    scale = ScaleColumns(self._source, index, out.per_unit, out.blocks)
                parametrize.register_parametrization(layer.layer, "weight", scale)
                for mixer in layer.head_mixers:  # a mix over the heads reads none removed
                    scale = ScaleColumns(self._source, index)
                    parametrize.register_parametrization(mixer, "weight", scale)
                for rescaled in layer.rescaled:  # and the rows a norm over all heads reads
                    rows = rescaled.rows
                    for name in ("weight", "bias") if rows.bias is not None else ("weight",):
                        scale = ScaleRows(self._source, index, rescaled.per_unit)
                        parametrize.register_parametrization(rows, name, scale)
            return
        if group.producers:  # a residual width: every producer's last affine rows
            for _layer, target in group.producers:
                names = ("weight", "bias") if target.bias is not None else ("weight",)
                for name in names:
                    scale = ScaleRows(self._source, index)
                    parametrize.register_parametrization(target, name, scale)
            return
        if getattr(group, "norm", None) is not None:  # a norm between: the rows it reads
            rows = group.norm_rows
            for name in ("weight", "bias") if rows.bias is not None else ("weight",):
                parametrize.register_parametrization(rows, name, ScaleRows(self._source, index))
            return
        if group.gated:  # the consumer's input columns: exact whatever the gate computes
            for consumer in group.kept_in:
                scale = ScaleColumns(self._source, index)
                parametrize.register_parametrization(consumer, "weight", scale)
            return
        for norm in group.response_norms:  # its bias would give removed channels back
            parametrize.register_parametrization(norm, "bias", ScaleLast(self._source, index))
        # a BN without affine parameters (a frozen one: its buffers) is masked on its output
        if self.mask_at != "activation" and _affine_rows(group.bn):
            for name in ("weight", "bias"):
                slot = len(self._fold)
                scale = ScaleRows(self._source, index)
                parametrize.register_parametrization(group.bn, name, scale)
                read_folded_first(group.bn, name, self._source, slot)
                self._fold.append((index, group.bn.parametrizations[name]))
        elif (
            self.mask_at != "activation"
            and group.bn is None
            and getattr(group.rows, "weight", None) is not None
        ):
            per_unit = group.channels_per_unit
            for name in ("weight", "bias") if group.rows.bias is not None else ("weight",):
                parametrize.register_parametrization(
                    group.rows, name, ScaleRows(self._source, index, per_unit)
                )
        else:  # on the activations, with the fused epilogue
            target = group.bn if group.bn is not None else group.rows
            # a linear layer's features are the last dim (batch, tokens, features)
            channel_dim = -1 if isinstance(group.layer, nn.Linear) else 1
            per_unit = group.channels_per_unit

            def hook(_module, _inputs, output, index=index, channel_dim=channel_dim):
                mask = self._source.get(index).to(output.dtype)
                if per_unit > 1:
                    mask = mask.repeat_interleave(per_unit)
                return masked_channel_epilogue(
                    output, mask, channel_dim=channel_dim, backend=self.epilogue_backend
                )

            self._handles.append(target.register_forward_hook(hook))

    def current_keep(self) -> torch.Tensor:
        """k per segment: fixed counts, or n sigmoid(theta) under budget='flops'. Under
        N:M the one N of the ``keep`` buffer, expand()ed over the blocks (a view the
        kernels read at stride 0), the same view every step while the buffer stays."""
        if self.budget == "flops":
            return self._kept_fractions() * self._sizes
        if self.nm is None:
            return self.keep
        # (Module.__getattr__ is slow)
        keep, view = cast(torch.Tensor, self._buffers["keep"]), self._keep_view
        if view is None or view._base is not keep:  # first use, or the module moved
            view = keep.expand(self.state.num_segments)
            self._keep_view = view
        return view

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
        return self._flops(self._kept_fractions())

    def _kept_fractions(self) -> torch.Tensor:
        """sigmoid(theta) per group (budget='flops'; a block's experts share one theta)."""
        alpha = torch.sigmoid(self.theta)
        return alpha if self._tie is None else alpha[self._tie]

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
        self._check_device(model)
        mask = self._transport(update=model.training and torch.is_grad_enabled())
        self._source.set(mask)
        self._source.in_forward = True
        self._fold_masks()

    def _refresh_fold(self, *_) -> None:
        """The BN parameters the fold multiplies, read from their parametrizations: once
        at construction, after a load_state_dict, which replaces them with assign=True,
        and after a conversion that replaced the first of them (folding the old ones
        would train tensors the model no longer has)."""
        self._fold_originals = [param_list.original for _, param_list in self._fold]
        # FSDP2 gathers a module's parameters only for its own forward
        self._fold_sharded |= any(is_sharded(p) for p in self._fold_originals)

    def _check_device(self, model: nn.Module) -> None:
        """Refuse a model moved without its pruner, naming both devices."""
        slot = self._device_witness
        witness = None if slot is None else slot[0]._parameters.get(slot[1])
        if witness is None:  # moved into a parametrization (the pruner's own, at construction)
            self._device_witness = slot = parameter_slot(model)
            witness = None if slot is None else slot[0]._parameters[slot[1]]
        # (Module.__getattr__ is slow: every step)
        device = cast(torch.Tensor, self._buffers["keep"]).device
        # (FSDP2's CPU offload keeps a shard on the CPU, gathered to the device for use)
        if witness is not None and witness.device != device and not is_sharded(witness):
            raise RuntimeError(
                f"the model's parameters are on {witness.device} but the pruner's scores and "
                f"transport state are on {device}: move the pruner with the model "
                f"(pruner.to('{witness.device}'))"
            )

    def _fold_masks(self) -> None:
        """Multiply every masked BN weight and bias by its mask at once (folded_products)
        instead of one multiply per parameter per forward: ResNet-50 has 66 of them, and
        an eager GPU step pays host time per op and per allocation."""
        # Under torch.compile the parameters are read through parametrize (read_folded_first)
        if not self._fold or torch.compiler.is_compiling():
            return
        originals = self._fold_originals
        # replaced by a conversion (a move to the meta device makes new tensors, fully_shard
        # sharded ones)
        if not self._fold_sharded and self._fold[0][1].original is not originals[0]:
            self._refresh_fold()
            originals = self._fold_originals
        # sharded (FSDP2's new tensors; ZeRO-3 partitions the same ones in place): each BN
        # reads its own through parametrize in its forward, where they are gathered
        if self._fold_sharded or is_sharded(originals[0]):
            self._fold_sharded = True
            self._source.folded = None
            return
        flat = self._source.flat
        assert flat is not None  # set by this forward's pre-hook, before the fold
        if self._fold_plan is None or (
            self._fold_plan.channels is not None and self._fold_plan.channels.device != flat.device
        ):
            self._fold_plan = FoldPlan.build(
                [index for index, _ in self._fold[0::2]], self.sizes, flat.device
            )
        if compiled():  # the same in one C++ autograd node (csrc/fold_products.cpp)
            products = _C.fold_products(originals, flat, self._fold_plan.channels)
        else:
            products = folded_products(flat, self._fold_plan, originals)
        self._source.set_folded(products, originals)

    def _magnitudes(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """|w| of the groups' weights, flat in the masks' order (N:M: block order)."""
        order = nm_rules.to_blocks if self.nm is not None else torch.flatten
        return torch.cat([order(w.abs()) for w in weights])

    def _scores(self) -> torch.Tensor:
        """This step's scores: the learned parameter, or |w| of the weights as they are now
        (differentiable: the mask's gradient reaches the weights)."""
        if self.scores is not None:
            return self.scores
        weights = [
            g.layer.parametrizations.weight.original
            if parametrize.is_parametrized(g.layer, "weight")
            else g.layer.weight  # the first masks, computed before the masks attach
            for g in self.groups
        ]
        if dist.is_available() and dist.is_initialized():  # (no walk in one process)
            self._refuse_sharded_magnitudes(weights)
        return self._magnitudes(weights).float()

    def _refuse_sharded_magnitudes(self, weights: list[torch.Tensor]) -> None:
        """|w| cannot be read from FSDP2's shards or ZeRO-3's partitions, which the forward
        pre-hook sees."""
        for group, weight in zip(self.groups, weights, strict=True):
            if is_sharded(weight):
                raise ValueError(
                    f"scores='magnitude' reads |w| of '{group.name}' before every forward, and "
                    "FSDP (or ZeRO-3) shards its weight then: train learned scores "
                    "(scores='learned') there, or under DistributedDataParallel"
                )

    def _transport(self, update: bool, scores: torch.Tensor | None = None) -> torch.Tensor:
        """The soft masks of all groups (from `scores`, default this step's), NaN/Inf
        scores read as the neutral 0.5."""
        return transport_mask(
            self._scores() if scores is None else scores,
            self.current_keep(),
            self.state,
            eps=self.eps,
            iters=self.iters,
            update=update,
            backend=self.backend,
            nonfinite="neutral",
        )

    def channel_scores(self) -> torch.Tensor:
        """The current soft masks (update=False): the top-k of each group is kept."""
        with torch.no_grad():
            scores = self._scores()  # |w| computed once under scores="magnitude"
            mask = self._transport(update=False, scores=scores)
        return mask + 1e-12 * scores.nan_to_num(0.5, 0.5, 0.5)  # ties (masks at 0 or 1)

    def attach(self, optimizer: torch.optim.Optimizer) -> StepHooks:
        """Commit the transport state after every `optimizer.step()`; returns the hooks'
        handle (its `remove()` detaches the pruner).

        When the process runs distributed (a torch.distributed process group of several
        ranks, as under DistributedDataParallel), the scores' gradients are also averaged
        over the ranks before every update (after the step's closure, where it has one),
        as DDP averages the model's: every rank then steps the same scores and computes the
        same masks and transport state. The model may be wrapped in DDP before or after
        the pruner is made.

        The step also drops the autograd graph of the last forward's masks (its backward
        has run): held into the next step it would keep the scores' and BN parameters'
        gradient accumulators alive, which breaks a CUDA-graph capture of that step.
        Every NONFINITE_CHECK_EVERY steps it also reads the skipped-step counts (the only
        host read of a DTP step) and warns, at most once per check, when a group skipped
        steps since the last check because its scores were NaN or Inf.
        """

        if not callable(getattr(optimizer, "register_step_post_hook", None)):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )

        hooks = [optimizer.register_step_post_hook(self._after_update)]
        if distributed():
            hooks.append(optimizer.register_step_pre_hook(self._average_before_update))
        return StepHooks(hooks)

    def _after_update(self, *_) -> None:
        """What follows every update of the scores: commit the transport state."""
        self._source.release_graph()
        self.state.commit()
        self._steps_since_check += 1
        if self.NONFINITE_CHECK_EVERY and self._steps_since_check >= self.NONFINITE_CHECK_EVERY:
            self._steps_since_check = 0
            self._warn_skipped()

    def _average_before_update(self, optimizer, args: tuple, kwargs: dict):
        """A step pre-hook: average the scores' gradients now, or, where the step gets a
        closure that computes them (Lightning's steps, LBFGS), after every call of it."""
        # (args are step()'s own: the optimizer first, then a positional closure if any)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._average_over_ranks()
            return None

        def averaged():
            loss = closure()
            self._average_over_ranks()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": averaged}
        return (args[0], averaged, *args[2:]), kwargs

    def name_weights_unmasked(self) -> None:
        """From now on the model's ``state_dict()`` holds every masked weight under its
        own key ("fc.weight", not "fc.parametrizations.weight.original"), the weight
        without its mask, and ``load_state_dict()`` takes it so: files a trainer writes
        of the model load into the model as it was built, before any pruner (a resumed
        run makes its pruner after loading them). :meth:`remove` and exports undo it."""
        self._handles.extend(name_weights_unmasked(self.model))

    def _average_over_ranks(self) -> None:
        """All-reduce the gradients of the pruner's own parameters to their mean."""
        ranks = dist.get_world_size()
        for parameter in self.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
                parameter.grad.div_(ranks)

    def _warn_skipped(self) -> None:
        counts = self.skipped_steps()
        new = [c - last for c, last in zip(counts, self._skipped_seen, strict=True)]
        self._skipped_seen = counts
        if any(new):
            groups = [(name, n) for name, n in zip(self._segment_names(), new, strict=True) if n]
            if self.budget == "global":
                groups = groups[:1]
            warnings.warn(
                "DTP: non-finite (NaN/Inf) scores made these groups skip steps since the last "
                f"check (their transport state was kept): {groups}; pruner.report() has the "
                "totals",
                RuntimeWarning,
                stacklevel=2,
            )

    def _segment_names(self) -> list[str]:
        if self.budget == "global":
            return ["all groups (global)"] * len(self.groups)
        return [g.name for g in self.groups]

    def _segments_per_group(self) -> list[int]:
        """Transport segments per group under budget 'layer': N:M's blocks, the groups of
        experts of group-limited routing, else one."""
        if self.nm is not None:
            return [size // self.nm[1] for size in self.sizes]
        return [getattr(g, "segments", 1) for g in self.groups]

    def skipped_steps(self) -> list[int]:
        """Per group: committed steps its transport state skipped for NaN/Inf scores
        (summed over the group's segments: N:M's blocks, groups of experts)."""
        counts = self.state.skipped_steps
        if self.budget == "global":
            return [int(counts[0])] * len(self.groups)
        return [int(part.sum()) for part in counts.split(self._segments_per_group())]

    @torch.no_grad()
    def hard_masks(self) -> list[torch.Tensor]:
        """0/1 mask per group (see ChannelPruner.hard_masks); under N:M, the N highest
        soft masks of every block of M, in block order."""
        if self._trial_masks is not None:  # a trial export of some groups (export_blame.py)
            return [mask.clone() for mask in self._trial_masks]
        if self.nm is None:
            return super().hard_masks()
        values = self.channel_scores().detach().float().cpu()
        n, m = self.nm
        return [nm_rules.hard_mask(part, n, m) for part in values.split(self.sizes)]

    def hard_masked(self) -> HardMasks:
        """Context manager: inside it the model runs with the hard 0/1 masks."""
        return HardMasks(self)

    def report(self) -> dict:
        """Base report plus, per group, the soft-mask mass inside the top k and the mean
        squared distance of the soft mask from the hard one (of the mask the group
        reads: a tie set's later groups report its first one's)."""
        result = super().report()
        with torch.no_grad():
            soft = self._transport(update=False).float().cpu().split(self.sizes)
        hard = self.hard_masks()
        skipped = self.skipped_steps()
        for row, source in zip(result["groups"], self.mask_of, strict=True):
            s, h = soft[source], hard[source].flatten().float().cpu()
            row["skipped_steps"] = skipped[source]
            row["mass_in_top_k"] = float((s * h).sum() / h.sum().clamp(min=1))
            row["distance_to_hard"] = float(((s - h) ** 2).mean())
        return result

    def config_describes_export(self, masks: list[torch.Tensor] | None = None) -> bool | None:
        if self.granularity == "filter":
            return super().config_describes_export(masks)
        # unstructured and N:M pruning keep every shape: the config as it is
        return super().config_describes_export([torch.ones(n) for n in self.sizes])

    def predicted_counts(self, masks: list[torch.Tensor] | None = None) -> tuple[int, int]:
        if self.granularity == "filter":
            return super().predicted_counts(masks)
        masks = self.hard_masks() if masks is None else masks
        pruned = sum(int(m.numel() - m.sum()) for m in masks)
        return self._base_params - pruned, self._base_flops  # zeros still run densely

    def export(self) -> nn.Module:
        """Filter granularity: the physically smaller network (see ChannelPruner.export).
        Weight granularity: a copy whose pruned weights are zero (same shapes).

        Before it returns, every group's root layer is checked to have kept exactly the
        channels its mask keeps, and the exported model is run on the example inputs
        against the model under its hard masks (both in eval mode); if either differs,
        ExportMismatchError says where instead of handing back a model that is silently
        wrong. When the run fails or differs, the groups to blame are found by exporting
        again with only some groups pruned (export_blame.py: up to 48 trial exports, on
        this failure path only) and the error names them with the ratios that leave them
        whole.

        A model FSDP2 shards (``fully_shard`` after the pruner was made) is refused: see
        :meth:`export_sharded`."""
        sharded = _sharded_parameters(self.model)
        if sharded:
            raise ValueError(
                f"export() copies the model whole, and FSDP shards the parameters of "
                f"{sharded[0]!r}: call pruner.export_sharded(model) on every rank, `model` "
                "built again as this one was and not sharded (docs/pruning.md)"
            )
        try:
            return self._checked_export()
        except _CheckRunError as error:
            if self._trial_masks is not None:
                raise
            raise self._blamed(error) from error

    @overload
    def export_sharded(self, unsharded: nn.Module) -> nn.Module: ...
    @overload
    def export_sharded(self, unsharded: None) -> None: ...
    def export_sharded(self, unsharded: nn.Module | None) -> nn.Module | None:
        """The export of a model FSDP2 shards (``fully_shard`` after the pruner was made),
        which export() cannot copy: every rank calls it with `unsharded`, the model built
        again as this pruner's model was (same class and config, any weights, no pruner,
        not sharded), into which the weights are gathered one tensor at a time; a pruner
        made on it as this one was, holding this one's scores and transport state,
        exports it with export()'s checks. A rank that passes None takes part in the
        gathering only and gets None. Every rank that builds one gets the same export
        (buffers FSDP does not shard, such as BN statistics, are rank 0's)."""
        return export_sharded(self, unsharded)

    def _checked_export(self) -> nn.Module:
        """The export with both of its checks."""
        if self.granularity == "filter":
            pruned = super().export()
            self._check_widths(pruned)
        else:
            pruned = self._unmasked_copy()
            modules = dict(pruned.named_modules())
            with torch.no_grad():
                for group, mask in zip(self.groups, self.hard_masks(), strict=True):
                    weight = modules[group.name].weight
                    mask = mask.to(weight.device, weight.dtype)
                    shaped = nm_rules.to_weight(mask, weight) if self.nm else mask.view_as(weight)
                    weight.mul_(shaped)
            linear_to_conv1d(pruned)  # GPT-2's layers in its own layout again (conv1d.py)
        self._check_export(pruned)
        return pruned

    def _check_widths(self, pruned: nn.Module) -> None:
        """Raise ExportMismatchError unless every channel group's root layer kept exactly
        the channels its hard mask keeps (outputs alone would not show a group whose
        channels Torch-Pruning removed in coupled sets: fewer kept, equal outputs)."""
        modules = dict(pruned.named_modules())
        for group, mask in zip(self.groups, self.hard_masks(), strict=True):
            if isinstance(
                group, (HeadGroup, ExpertGroup, WholeExpertsGroup, MambaGroup, Mamba2Group)
            ):
                continue  # prune_heads / prune_experts / ... cut the kept units
            width = out_width(modules[group.name])
            want = int(mask.sum()) * group.channels_per_unit * group.parts
            if width != want:
                raise ExportMismatchError(
                    f"layer {group.name!r} kept {width} output channels where its mask keeps "
                    f"{want}: Torch-Pruning removed its channels in coupled sets; leave it "
                    "whole with ignored_layers=[...]"
                )

    @torch.no_grad()
    def _check_export(self, pruned: nn.Module) -> None:
        """Raise ExportMismatchError unless `pruned` computes what the hard-masked model
        does. Outputs in half precision that part by more than its tolerance are compared
        again with both models' weights in float32: rounding grows with depth (a deep
        bfloat16 LLM's sums over fewer terms, its export's, part by a few percent), while
        a wrong export differs in float32 too."""
        want, got = self._check_outputs(pruned, float32=False)
        mismatch = _mismatch(got, want)
        if mismatch is None:
            return
        if not any(w.dtype in HALF for w in want):
            raise _CheckRunError(*mismatch)
        try:
            want, got = self._check_outputs(pruned, float32=True)
        except torch.OutOfMemoryError:
            raise ExportMismatchError(
                f"{mismatch[0]}, more than half-precision rounding allows in one layer; the "
                "check that tells a deep model's rounding from a wrong export, the same "
                "weights run in float32, ran out of memory: export with the model and the "
                "pruner on the CPU (model.cpu(); pruner.cpu()), or in float32"
            ) from None
        mismatch = _mismatch(got, want)
        if mismatch is not None:
            raise _CheckRunError(mismatch[0] + " with the weights in float32", mismatch[1])

    def _check_outputs(
        self, pruned: nn.Module, float32: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the hard-masked model's outputs, the exported model's) on the example inputs,
        in eval mode, with float32 products; with `float32`, each model's half-precision
        weights (and the inputs) in float32 while it runs, one model at a time."""
        was_training, pruned_training = self.model.training, pruned.training
        self.model.eval()
        pruned.eval()
        inputs = on_model_device(self.example_inputs, self.model)
        inputs = in_float32(inputs) if float32 else inputs
        widened = float32_weights if float32 else lambda _: contextlib.nullcontext()
        try:
            with ieee_fp32(), widened(self.model), self.hard_masked():
                want = output_tensors(call_model(self.model, inputs))
            with ieee_fp32(), widened(pruned):
                try:
                    got = output_tensors(call_model(pruned, inputs))
                except Exception as error:
                    raise _CheckRunError(
                        f"the exported model fails on the example inputs "
                        f"({type(error).__name__}: {error})",
                        "something they reach still has their old size (a reshape to the "
                        "input's shape, a table with an entry per head or channel outside "
                        "the pruned layers, such as a position bias all attention layers "
                        "share)",
                    ) from error
        finally:
            self.model.train(was_training)
            pruned.train(pruned_training)
        if len(got) != len(want):
            raise ExportMismatchError(
                f"the exported model returns {len(got)} tensors, the masked one {len(want)}"
            )
        return want, got

    def _blamed(self, error: _CheckRunError) -> ExportMismatchError:
        """The error of a failed check run, naming the groups whose pruning alone makes
        the export fail (export_blame.py)."""
        masks = self.hard_masks()
        pruned = [i for i, mask in enumerate(masks) if bool((mask == 0).any())]
        if not pruned:  # nothing cut, and still it fails: no group to blame
            return ExportMismatchError(str(error))

        def export_fails(subset: list[int]) -> bool | None:
            chosen = set(subset)
            self._trial_masks = [
                mask if i in chosen else torch.ones_like(mask) for i, mask in enumerate(masks)
            ]
            try:
                with warnings.catch_warnings():  # the first export has given them
                    warnings.simplefilter("ignore")
                    self._checked_export()
            except _CheckRunError:
                return True
            except Exception:  # failed before the check run: it cannot tell
                return None
            finally:
                self._trial_masks = None
            return False

        culprits = culprit_groups(pruned, export_fails, TRIAL_EXPORTS)
        if culprits is None:
            names = [self.groups[i].name for i in pruned]
            return ExportMismatchError(
                f"{error.what}: among the pruned groups {names[:8]}"
                f"{' ...' if len(names) > 8 else ''}, {error.why}; the groups to blame were "
                f"not found within {TRIAL_EXPORTS} trial exports: leave the groups that "
                "reach it whole with ignored_layers=[...]"
            )
        names = [self.groups[i].name for i in culprits]
        return ExportMismatchError(
            f"{error.what}: an export with only the groups {names} pruned fails this check "
            f"too, so {error.why}. Leave them whole with ignored_layers=[...] or a ratio of 0 "
            f"for them: {zero_ratios(self._asked_ratios, names)}"
        )

    def _unmasked_copy(self) -> nn.Module:
        """A deep copy of the model without this pruner's masks, hooks and state."""
        memo = {id(self): self, id(self._source): MaskSource(self.sizes)}  # do not copy these
        pruned = copy.deepcopy(self.model, memo)
        for module in list(pruned.modules()):
            for handle in self._handles:
                module._forward_pre_hooks.pop(handle.id, None)
                module._forward_hooks.pop(handle.id, None)
                module._load_state_dict_post_hooks.pop(handle.id, None)
                module._state_dict_hooks.pop(handle.id, None)
                module._load_state_dict_pre_hooks.pop(handle.id, None)
            if parametrize.is_parametrized(module):
                strip_parametrizations(module)
            if isinstance(module.__dict__.get("forward"), MaskedRouting):
                unmask_router(module)
        return pruned

    def remove(self) -> None:
        """Detach the pruner from the model: hooks, parametrizations and routers' masks are
        removed and the unmasked weights restored."""
        for handle in self._handles:
            handle.remove()
        for group in self.groups:
            if isinstance(group, WholeExpertsGroup):
                unmask_router(group.router)
        for module in list(self.model.modules()):
            if parametrize.is_parametrized(module):
                strip_parametrizations(module)


def _mismatch(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[str, str] | None:
    """(what differs, its usual cause) where an output of the exported model is not the
    hard-masked model's within the proof's tolerance for its dtype (sums over fewer
    (zero) terms, and a norm's rescaled weights (head_norms.py), round apart in half
    precision); None where all are."""
    for g, w in zip(got, want, strict=True):
        if not close(g, w):
            rtol, atol = TOLERANCES.get(w.dtype, FP32_TOLERANCE)
            error = float((g - w).abs().max()) if g.shape == w.shape else float("inf")
            return (
                f"the exported model's output differs from the hard-masked model's by "
                f"{error:.3g} (allowed {rtol} relative, {atol} times its largest "
                "magnitude absolute)",
                "some layer after them changes what removing channels does (a "
                "normalization over channels, a reshape, a custom op)",
            )
    return None


class _CheckRunError(ExportMismatchError):
    """The exported model failed the run of the example inputs: `what` happened, `why`
    the usual cause; export() turns it into an error that names the groups."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")
        self.what, self.why = what, why


def _affine_rows(norm: nn.Module | None) -> bool:
    """Whether a group's per-channel norm has a weight and a bias to take its mask (an
    affine BN or InstanceNorm, a per-channel affine layer; not a frozen BN's buffers)."""
    return all(isinstance(getattr(norm, n, None), nn.Parameter) for n in ("weight", "bias"))
