"""What every channel pruner here shares: groups, ratios, hard masks, report, export.

A pruner scores the channels of each group (`channel_scores`); the base class finds
the groups, turns ratios into exact kept counts, predicts parameters and FLOPs after
pruning, and exports the physically smaller network (channel groups with Torch-Pruning,
attention heads and experts by cutting their rows and columns directly).
"""

from __future__ import annotations

import abc
import contextlib
import copy
import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from . import masking
from . import ratios as ratio_rules
from .channel_graph import ChannelGraphError, traced_graph
from .channel_rms_norms import adopt_rms_norms, cut_and_rescale
from .conv1d import is_conv1d, linear_to_conv1d
from .cost import (
    COSTED,
    PER_CHANNEL_AFFINE,
    count_params,
    extra_parameters,
    flops_after,
    params_after,
    trace_layers,
)
from .example_inputs import as_example_inputs, call_model, on_model_device
from .experts import (
    ExpertGroup,
    ExpertProjection,
    Layout,
    check_expert_ratios,
    find_expert_groups,
    prune_experts,
    run_misaligned_experts,
    unrecognised_experts,
)
from .gated_deltanet import find_linear_attention_groups
from .group_kinds import asks_only_graphless, kind_of, with_kinds_found
from .group_search import UNFOLLOWED
from .grouped_convs import check_grouped_conv_ratios, cut_grouped_inputs, is_grouped
from .groups import find_groups, out_channel_handler
from .heads import (
    HeadGroup,
    check_shard_ratios,
    find_head_groups,
    prune_heads,
)
from .hf_config import predicts_described, update_config
from .layer_fates import layer_fates, warn_idle_layers
from .mamba import MambaGroup, find_mamba_groups, prune_mamba
from .mamba2 import Mamba2Group, check_mamba2_ratios, find_mamba2_groups
from .mlps import FormMLPGroup, find_form_mlps, prune_form_mlp
from .ratios import Ratios
from .recurrent_readers import RECURRENT
from .refusals import refuse_inexact
from .response_norms import adopt_response_norms, rescale_response_norm
from .shared_kv import tie_kv_sharing
from .shared_weights import (
    holders,
    tie_again,
    tie_weight_sharing_heads,
    weight_copies,
)
from .split_gated_convs import (
    SplitGatedConvGroup,
    find_split_gated_convs,
    prune_split_gated_conv,
)
from .tied_heads import tie_chains
from .whole_experts import (
    MaskedRouting,
    WholeExpertsGroup,
    check_whole_expert_ratios,
    find_whole_expert_groups,
    prune_whole_experts,
    set_model_counts,
)

# the layers of a latent attention (DeepSeek-V2, V3) computing the compressed latents
LATENT_LAYERS = ("q_a_proj", "kv_a_proj_with_mqa")


def _check_tied_names(ratios, groups: list) -> None:
    """A ratios dict may not name a layer whose heads are tied to another's (T5's, whose
    first layer of a stack computes the bias per head for the others: tied_heads.py):
    ValueError naming the layer the ratio goes to."""
    if not isinstance(ratios, Mapping):
        return
    first = {m.name: g.name for g in groups for m in getattr(g, "tied", ())[1:]}
    named = {key: first[key] for key in ratios if key in first}
    if named:
        key, to = next(iter(named.items()))
        raise ValueError(
            f"ratios names {sorted(named)}: the heads of {key!r} are tied to those of "
            f"{to!r}, which computes the bias per head its stack's layers add, so they "
            f"are one group, named {to!r}: give the ratio to that name (or to 'heads')"
        )


class ExportMismatchError(ValueError):
    """export() produced a model that does not compute what the hard-masked one does."""


try:  # FSDP2's and tensor parallelism's shards
    from torch.distributed.tensor import DTensor

    SHARDED: tuple[type, ...] = (DTensor,)
except ImportError:  # torch without distributed: nothing is sharded
    SHARDED = ()


def is_sharded(parameter: torch.Tensor) -> bool:
    """Whether `parameter` is a shard (a DTensor: FSDP2, tensor parallelism) or one
    DeepSpeed's ZeRO stage 3 partitioned (marked with ``ds_id``; empty outside its
    module's forward): whole only while its module runs, if at all."""
    return isinstance(parameter, SHARDED) or hasattr(parameter, "ds_id")


def _sharded_parameters(model: nn.Module) -> list[str]:
    """The modules of `model` whose parameters FSDP (either version), tensor parallelism
    or DeepSpeed's ZeRO stage 3 shards across ranks."""
    if not dist.is_available():
        return []
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [
        name or type(model).__name__
        for name, module in model.named_modules()
        if isinstance(module, FullyShardedDataParallel)
        or any(is_sharded(p) for p in module.parameters(recurse=False))
    ]


def _ignored_modules(model: nn.Module, ignored: Iterable[nn.Module | str]) -> list[nn.Module]:
    """`ignored_layers` as modules of `model`, each given as one of its modules or its
    name, with every module inside them (a block leaves all its layers whole); TypeError
    or ValueError naming the entry otherwise (a module of another model or a misspelt
    name would leave nothing whole, without a word)."""
    if isinstance(ignored, (str, nn.Module)) or not isinstance(ignored, Iterable):
        raise TypeError(
            "ignored_layers must be a list of the model's modules or their names, got "
            f"{type(ignored).__name__}"
            + (" (put it in a list)" if isinstance(ignored, (str, nn.Module)) else "")
        )
    names = {module: name for name, module in model.named_modules()}
    modules: list[nn.Module] = []
    for index, entry in enumerate(ignored):
        if isinstance(entry, str):
            module = dict(model.named_modules()).get(entry)
            if module is None:
                raise ValueError(
                    f"ignored_layers[{index}] = {entry!r} names no module of "
                    f"{type(model).__name__} (module names as model.named_modules() gives them)"
                )
        elif isinstance(entry, nn.Module):
            if entry not in names:
                raise ValueError(
                    f"ignored_layers[{index}] is a {type(entry).__name__} that is not a module "
                    f"of this {type(model).__name__}"
                )
            module = entry
        else:
            raise TypeError(
                f"ignored_layers[{index}] is a {type(entry).__name__}; give the model's modules "
                "or their names"
            )
        modules.extend(module.modules())
    return list(dict.fromkeys(modules))


def _carries_masks(module: nn.Module) -> bool:
    """Whether a pruner's masks are on `module` (a parametrization of masking.py, a
    router's masked forward)."""
    if isinstance(vars(module).get("forward"), MaskedRouting):
        return True
    return parametrize.is_parametrized(module) and any(
        masking.is_mask(p) for plist in masking.parametrizations(module).values() for p in plist
    )


class ChannelPruner(nn.Module, metaclass=abc.ABCMeta):
    """Exact-size filter pruning of `model` (the model is referenced, not owned)."""

    model: nn.Module  # set with object.__setattr__: referenced, not a submodule

    BUDGETS: tuple[str, ...] = ("layer", "global")

    def __init__(
        self,
        model: nn.Module,
        example_inputs: torch.Tensor | tuple | Mapping,
        ratios: Ratios,
        *,
        budget: str = "layer",
        ignored_layers: Sequence[nn.Module | str] = (),
        prune_coupled: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        ignored_layers = _ignored_modules(model, ignored_layers)
        if not isinstance(prune_coupled, bool):
            raise TypeError(f"prune_coupled must be a bool, got {type(prune_coupled).__name__}")
        self.prune_coupled = prune_coupled
        if budget not in self.BUDGETS:
            raise ValueError(f"budget = {budget!r}; allowed: {list(self.BUDGETS)}")
        conv1d = [name for name, module in model.named_modules() if is_conv1d(module)]
        if conv1d:
            raise ValueError(
                f"{type(model).__name__} writes its linear layers as transformers' Conv1D "
                f"({conv1d[0]!r} and {len(conv1d) - 1} more), which the pruner does not mask "
                "or export; convert them with dtp_kernels.conv1d_to_linear(model) first, "
                "before making the optimizer (the layers get new parameters)"
            )
        masked = [name for name, module in model.named_modules() if _carries_masks(module)]
        if masked:
            raise ValueError(
                f"the model already carries a pruner's masks ({masked[0]!r} and "
                f"{len(masked) - 1} more layers): call remove() on that pruner first"
            )
        sharded = _sharded_parameters(model)
        if sharded:
            more = f" and {len(sharded) - 1} more modules" if len(sharded) > 1 else ""
            raise ValueError(
                f"the parameters of {sharded[0]!r}{more} are sharded (FSDP, tensor "
                "parallelism or DeepSpeed ZeRO-3): DTP's masks multiply whole weights. Make "
                "the pruner before FSDP2's fully_shard or deepspeed.initialize (ZeRO-3; "
                "docs/pruning.md), train under "
                "DistributedDataParallel (the pruner averages its scores over the ranks), or "
                "prune before sharding and shard the exported model"
            )
        inputs = as_example_inputs(example_inputs)
        was_training = model.training
        ran: set[nn.Module] = set()  # the modules the example forward calls
        hooks = [m.register_forward_pre_hook(lambda m, _: ran.add(m)) for m in model.modules()]
        try:
            with torch.no_grad():
                model.eval()
                call_model(model, inputs)
        except Exception as error:
            raise ValueError(
                f"example_inputs do not run through the model: {type(error).__name__}: {error}"
            ) from error
        finally:
            model.train(was_training)
            for hook in hooks:
                hook.remove()
        object.__setattr__(self, "model", model)  # not a submodule: the pruner is not the model
        self.example_inputs = inputs
        self.budget = budget
        self._asked_ratios = ratios  # named back, with zeros, in advice to leave groups whole
        # set by _find_groups when Torch-Pruning's graph cannot follow the model
        self._graph_error: ChannelGraphError | None = None
        # filled by _find_groups: why layers whose output channels no group holds are whole
        self._whole_reasons: dict[nn.Module, str] = {}
        try:
            all_groups = self._find_groups(model, inputs, list(ignored_layers))
        finally:
            model.train(was_training)  # Torch-Pruning's tracing leaves the model in eval mode
        # attention layers the example never runs (a vision-language model's vision tower
        # on text) stay whole, as idle conv and linear layers do: nothing would check them,
        # and one that could not be pruned need not be refused
        all_groups = [
            g
            for g in all_groups
            if not isinstance(g, HeadGroup) or any(m.module in ran for m in g.members)
        ]
        convs = [name for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]
        if self._graph_error is not None and not asks_only_graphless(ratios, all_groups):
            raise with_kinds_found(self._graph_error, ratios, all_groups)
        self._graph_error = None  # its traceback would hold the failed trace's frames
        kinds = {g.name: kind_of(g) for g in all_groups}
        _check_tied_names(ratios, all_groups)
        per_group = ratio_rules.resolve(
            ratios,
            [g.name for g in all_groups],
            {n: i for i, n in enumerate(convs)},
            len(convs),
            kinds,
        )
        experts = [g for g in all_groups if isinstance(g, ExpertGroup)]
        check_expert_ratios(experts, per_group, budget)
        check_whole_expert_ratios(all_groups, per_group, budget)
        check_mamba2_ratios(all_groups, per_group, budget)
        check_grouped_conv_ratios(all_groups, per_group, budget)
        check_shard_ratios(all_groups, per_group, budget)
        self.groups = [g for g in all_groups if per_group[g.name] > 0]
        self._layer_fates = layer_fates(
            model, all_groups, per_group, ignored_layers, ran, self._whole_reasons
        )
        self._whole_reasons = {}  # the modules are the model's: hold them no longer
        # every group that cannot be pruned exactly goes in one error (refusals.py); what
        # comes back are the sets of groups that prune with one mask (shared_weights.py)
        tied = refuse_inexact(
            model, self.groups, all_groups, per_group, budget, ran, inputs, ratios
        )
        if not self.groups:
            whole = [f"{n}: {why}" for n, why in self._layer_fates.items() if isinstance(why, str)]
            if all_groups:
                found = f"its groups: {[g.name for g in all_groups][:8]}"
            elif whole:  # why each layer is left whole (the first few)
                more = f"; and {len(whole) - 4} more" if len(whole) > 4 else ""
                found = f"no group was found in it; {'; '.join(whole[:4])}{more}"
            else:
                found = "no group was found in it: it has no convolution or linear layer"
            raise ValueError(f"the ratios prune nothing of this model ({found})")
        self.ratios = {g.name: per_group[g.name] for g in self.groups}
        self.sizes = [g.size for g in self.groups]
        # each group's mask: its own, or that of the first group of its tie set
        index = {id(g): i for i, g in enumerate(self.groups)}
        self.mask_of = list(range(len(self.groups)))
        for members in tied:
            if id(members[0]) in index:  # (a set left whole by its ratios is no group)
                for g in members[1:]:
                    self.mask_of[index[id(g)]] = index[id(members[0])]
        if budget != "global":
            self.kept = [ratio_rules.kept_count(g.size, self.ratios[g.name]) for g in self.groups]
        else:  # one budget over all groups, from the (single) ratio
            distinct = set(self.ratios.values())
            if len(distinct) != 1:
                raise ValueError("budget='global' needs one ratio for all groups (a float)")
            self.kept = [ratio_rules.kept_count(sum(self.sizes), distinct.pop())]
        self._base_params = count_params(model)
        self._layers = trace_layers(model, inputs)  # the cost model's view of the model
        self._base_flops = flops_after(self._layers, {})
        pruned = [  # a Mamba mixer's conv1d and dt_proj are read, not called
            m
            for g in self.groups
            for m in (*getattr(g, "kept_out", ()), *getattr(g, "kept_in", ()))
        ]
        warn_idle_layers(model, self._layers, [*ignored_layers, *pruned])
        unknown = unrecognised_experts(model, list(ignored_layers))
        if unknown:
            warnings.warn(
                f"the experts of {unknown} are kept in raw parameters in a layout the "
                "pruner does not recognise (it reads transformers' experts layout, described "
                "by use_experts_implementation), so they are left whole",
                UserWarning,
                stacklevel=3,
            )

    def _find_groups(self, model: nn.Module, inputs: tuple, ignored: list) -> list:
        """The prunable groups (filter pruning) in the model's module order: attention
        heads, the experts of mixture-of-experts blocks and channel groups (where
        Torch-Pruning's graph fails: MLP modules found by their form)."""
        linear = find_linear_attention_groups(model, ignored)  # no attention form of theirs
        found = find_head_groups(model, ignored + [g.module for g in linear], inputs)
        heads = tie_kv_sharing(tie_chains(model, found, inputs)) + linear
        heads = tie_weight_sharing_heads(heads)  # a block several layers share: one group
        experts = find_expert_groups(model, ignored)
        whole = find_whole_expert_groups(model, ignored, inputs)
        mixers: list[MambaGroup | Mamba2Group] = [
            *find_mamba_groups(model, ignored, inputs),
            *find_mamba2_groups(model, ignored, inputs),
        ]
        projections = [layer for g in heads + mixers for layer in (*g.kept_out, *g.kept_in)]
        # a latent attention's compressed latents serve all its heads and stay whole
        latents = [
            layer
            for g in heads
            if g.latent
            for name in LATENT_LAYERS
            if isinstance(layer := getattr(g.module, name, None), nn.Linear)
        ]
        for layer in latents:
            self._whole_reasons[layer] = "a latent attention's compressed latent: all heads read it"
        projections += latents
        # a router that is a linear layer is cut with its experts, no group of its own
        projections += [g.router for g in whole if isinstance(g.router, nn.Linear)]
        # a linear layer computing one output per head (a table cut with the heads: Swin
        # V2's bias MLP, Laguna's gate per head) is no group root of its own
        projections += [o for g in heads for o, _, _ in g.tables if isinstance(o, nn.Linear)]
        try:
            with traced_graph(model, inputs) as graph:
                channels = find_groups(
                    model, graph, ignored + projections, self.prune_coupled, self._whole_reasons
                )
            adopt_response_norms(model, channels, inputs)
            adopt_rms_norms(model, channels, inputs)
            # MLPs with a norm over their hidden width, which the graph leaves out
            grouped = [m for g in channels for m in (g.layer, *g.kept_out, *g.kept_in)]
            channels += find_form_mlps(model, ignored + projections + grouped, inputs, True)
        except ChannelGraphError as error:  # raised unless the ratios need no graph
            self._graph_error = error
            for layer in model.modules():
                self._whole_reasons.setdefault(
                    layer,
                    "Torch-Pruning's channel graph fails on the model (only heads, "
                    "experts, Mamba mixers and MLPs found by their form prune)",
                )
            channels = [*find_form_mlps(model, ignored + projections, inputs)]
        # gated convolution blocks split unequally, which the graph cannot follow
        grouped = [m for g in channels for m in (g.layer, *g.kept_out, *g.kept_in)]
        channels += find_split_gated_convs(model, ignored + projections + grouped, inputs)
        order = {name: index for index, (name, _) in enumerate(model.named_modules())}

        def position(group) -> tuple[int, int]:  # a block's experts in turn, together
            if isinstance(group, ExpertGroup):
                return order[group.module_name], group.expert
            return order[group.name], 0

        return sorted([*heads, *whole, *experts, *mixers, *channels], key=position)

    # -- what a pruner decides -----------------------------------------------------------
    @abc.abstractmethod
    def channel_scores(self) -> torch.Tensor:
        """One importance value per channel, flat over the groups (higher = keep)."""

    def kept_counts(self) -> list[int]:
        """Channels to keep per group (one entry, for all groups, under budget='global')."""
        return self.kept

    # -- shared --------------------------------------------------------------------------
    @property
    def left_whole(self) -> dict[str, str]:
        """Every conv and linear layer that no group cuts, by name in model order, with
        why: a ratio of 0, `ignored_layers`, not called on the example inputs, its
        channels coupled with others' (and where), the model's outputs, ..., or its
        groups keeping all their units under the current hard masks (a group of one
        unit always does). Exactly these layers keep their shapes in the export."""
        masks = self.hard_masks()
        full = {g.name for g, m in zip(self.groups, masks, strict=True) if bool(m.all())}
        whole = {}
        for name, fate in self._layer_fates.items():
            if isinstance(fate, str):
                whole[name] = fate
            elif all(group in full for group in fate):
                whole[name] = f"its group {fate[0]!r} keeps all its units" + (
                    f" (as do {fate[1:]})" if len(fate) > 1 else ""
                )
        return whole

    @torch.no_grad()
    def hard_masks(self) -> list[torch.Tensor]:
        """0/1 float mask per group: the top-k channels by `channel_scores()`.

        Per layer, exactly k per group (a group of s equal segments, whole experts under
        group-limited routing: k / s per segment). Global: the top-k over all groups, and
        each group's best channel on top of that if it would otherwise lose every channel.
        """
        values = self.channel_scores().detach().float().cpu()
        parts = list(values.split(self.sizes))
        kept = self.kept_counts()
        if self.budget != "global":
            masks = []
            for group, part, k in zip(self.groups, parts, kept, strict=True):
                segments = getattr(group, "segments", 1)
                mask = torch.zeros(segments, len(part) // segments)
                top = torch.topk(part.view(segments, -1), k // segments, sorted=False)
                masks.append(mask.scatter_(1, top.indices, 1.0).flatten())
            return [masks[i] for i in self.mask_of]  # a tie set's groups: its first's
        flat = torch.zeros_like(values)
        flat[torch.topk(values, kept[0], sorted=False).indices] = 1.0
        masks = list(flat.split(self.sizes))
        for part, mask in zip(parts, masks, strict=True):
            if mask.sum() == 0:
                mask[part.argmax()] = 1.0
        return masks

    def _kept_channels(
        self, masks: list[torch.Tensor]
    ) -> dict[nn.Module | ExpertProjection, tuple[int, int]]:
        """Per affected module (or expert's projection): (output channels lost, input
        channels lost)."""
        lost: dict[nn.Module | ExpertProjection, list[int]] = {}
        for group, mask in zip(self.groups, masks, strict=True):
            if hasattr(group, "channels_lost"):  # which units go decides it
                for module, counts in group.channels_lost(mask).items():
                    entry = lost.setdefault(module, [0, 0])
                    entry[0], entry[1] = entry[0] + counts[0], entry[1] + counts[1]
                continue
            pruned = int(mask.numel() - mask.sum())
            width = getattr(group, "width", {})  # channels per unit (heads); else 1
            for module in group.kept_out:
                lost.setdefault(module, [0, 0])[0] += pruned * width.get(module, 1)
            for module in group.kept_in:
                lost.setdefault(module, [0, 0])[1] += pruned * width.get(module, 1)
            # a linear layer of one output per head (Swin V2's bias MLP, a position table
            # several layers share): its rows go with the heads, FLOPs and parameters
            for owner in {o for o, _, dim in getattr(group, "tables", ()) if dim == 0}:
                if isinstance(owner, nn.Linear):
                    rows = pruned * getattr(group, "rows_per_table_unit", 1)
                    lost.setdefault(owner, [0, 0])[0] += rows
        return {m: (a, b) for m, (a, b) in lost.items()}

    @torch.no_grad()
    def predicted_counts(self, masks: list[torch.Tensor] | None = None) -> tuple[int, int]:
        """(parameters, FLOPs) after pruning with `masks`, computed from the layer shapes."""
        masks = self.hard_masks() if masks is None else masks
        lost = self._kept_channels(masks)
        params = 0
        owners: dict[nn.Parameter, int] = {}
        copies = weight_copies(self.model)  # counted, and cut alike, with the first holder
        cut = dict(lost)  # a copy cut where its first holder is not (one it never runs)
        for holder, first in copies.items():
            if holder in lost and first is not None:
                cut.setdefault(first, lost[holder])
        for module in self.model.modules():
            if module in copies:
                continue
            # a layer the model parametrizes itself is never cut: its own parameters count
            formula = isinstance(
                module, (*COSTED, *PER_CHANNEL_AFFINE, nn.MultiheadAttention, *RECURRENT)
            )
            if formula and not masking.foreign_parametrizations(module):
                params += params_after(module, *cut.get(module, (0, 0)))
                params += extra_parameters(module)
            elif not isinstance(module, parametrize.ParametrizationList):  # owner counts it
                params += sum(p.numel() for p in module.parameters(recurse=False))
                if parametrize.is_parametrized(module):  # an experts block's masked weight
                    lists = masking.parametrizations(module).values()
                    params += sum(p.numel() for plist in lists for p in plist.parameters())
            for p in module.parameters(recurse=False):
                owners[p] = owners.get(p, -1) + 1
        # a weight tied between modules holding other weights too (an embedding and an
        # output layer with a bias) counts once; such weights are never pruned
        params -= sum(p.numel() * extra for p, extra in owners.items())
        for group, mask in zip(self.groups, masks, strict=True):
            # raw 3-D parameters: no layer formula
            if isinstance(group, (ExpertGroup, WholeExpertsGroup)):
                params -= group.removed_params(int(mask.numel() - mask.sum()))
            # a norm over the units (heads, a GRN) loses the removed units' parameters
            for _norm, per_unit in getattr(group, "cut_norms", ()):
                params -= int(mask.numel() - mask.sum()) * per_unit
            # an attention layer's raw vectors of its query rows
            for _owner, _name in getattr(group, "row_vectors", ()):
                rows = group.query_heads_per_unit * group.head_dim
                params -= int(mask.numel() - mask.sum()) * rows
            # per-head tables; a Mamba mixer's per-channel parameters; raw per-channel scales
            for owner, name, dim in [*getattr(group, "tables", ()), *getattr(group, "scales", ())]:
                if isinstance(owner, nn.Linear) and dim == 0:  # its rows: in `lost` above
                    continue
                table = getattr(owner, name)
                removed = int(mask.numel() - mask.sum()) * getattr(group, "rows_per_table_unit", 1)
                params -= table.numel() // table.shape[dim] * removed
        kept_rows = {  # layers run on each head apart (MViT's pooling convs)
            layer: (int(mask.sum()), mask.numel())
            for group, mask in zip(self.groups, masks, strict=True)
            for layer in getattr(group, "per_head_layers", ())
        }
        return params, flops_after(self._layers, lost, kept_rows)

    @torch.no_grad()
    def report(self) -> dict:
        """Per group its kind, n and k and the group whose mask it reads (its own, or
        the first of its tie set: shared_weights.py); totals of parameters and FLOPs
        before and after pruning; the layers left whole."""
        masks = self.hard_masks()
        params, flops = self.predicted_counts(masks)
        return {
            "groups": [
                {
                    "name": g.name,
                    "kind": kind_of(g),  # as ratio dicts name it: "heads", "mlp", ...
                    "n": g.size,
                    "k": int(m.sum()),
                    "ratio": self.ratios[g.name],
                    "mask_of": self.groups[source].name,
                }
                for g, m, source in zip(self.groups, masks, self.mask_of, strict=True)
            ],
            "params_before": self._base_params,
            "params_after": params,
            "flops_before": self._base_flops,
            "flops_after": flops,
            "sparsity": 1 - params / self._base_params,
            "speedup": self._base_flops / flops,
            "left_whole": dict(self.left_whole),
        }

    @torch.no_grad()
    def config_describes_export(self, masks: list[torch.Tensor] | None = None) -> bool | None:
        """Whether export() will write the pruned sizes into the model's transformers
        config so that save_pretrained / from_pretrained rebuild the exported model,
        predicted before any export from the counts `masks` keep (the current hard masks:
        under a learned budget, the counts learned so far). None for a model without a
        transformers config. Exact where the parameter count predicted_counts gives is
        the export's (every architecture of benchmarks/hf_prune_check.py)."""
        masks = self.hard_masks() if masks is None else masks
        params, _ = self.predicted_counts(masks)
        kinds = [(kind_of(g), g) for g in self.groups]
        return predicts_described(self.model, kinds, masks, params)

    def export(self) -> nn.Module:
        """A physically smaller copy of the model: Torch-Pruning removes the channels whose
        hard mask is 0. Its eval-mode outputs equal the hard-masked model's."""
        masks = self.hard_masks()
        self._check_shared_head_counts(masks)
        pruned = self._unmasked_copy()
        tied = holders(pruned)  # tied weights: each held by several modules of the copy
        # per experts module: its layout and its experts' masks in order
        expert_masks: dict[str, tuple[Layout, list[torch.Tensor]]] = {}
        needs_graph = any(
            not isinstance(
                g,
                (HeadGroup, ExpertGroup, WholeExpertsGroup, FormMLPGroup, MambaGroup, Mamba2Group),
            )
            for g in self.groups
        )
        graph_or_none = (
            traced_graph(pruned, on_model_device(self.example_inputs, pruned))
            if needs_graph
            else contextlib.nullcontext()
        )
        with graph_or_none as graph:
            names = dict(pruned.named_modules())
            original_names = {module: name for name, module in self.model.named_modules()}
            for group, mask in zip(self.groups, masks, strict=True):
                if isinstance(group, HeadGroup):
                    prune_heads(group, names, original_names, mask)
                    continue
                if isinstance(group, SplitGatedConvGroup):
                    prune_split_gated_conv(names[original_names[group.block]], mask)
                    continue
                if isinstance(group, FormMLPGroup):
                    prune_form_mlp(group, names, original_names, mask)
                    continue
                if isinstance(group, (MambaGroup, Mamba2Group)):
                    prune_mamba(group, names, mask)
                    continue
                if isinstance(group, WholeExpertsGroup):
                    prune_whole_experts(group, names, original_names, mask)
                    continue
                if isinstance(group, ExpertGroup):
                    expert_masks.setdefault(group.module_name, (group.layout, []))[1].append(mask)
                    continue
                dropped_units = (mask == 0).nonzero().flatten()
                if not len(dropped_units):
                    continue
                layer = names[group.name]
                drop = group.channels(dropped_units).tolist()
                # their inputs are cut group by group below, from these weights
                grouped = {
                    conv: conv.weight
                    for m in group.kept_in
                    if is_grouped(conv := names[original_names[m]])
                }
                assert graph is not None  # needs_graph: the graph cuts this group
                cut = graph.get_pruning_group(layer, out_channel_handler(layer), drop)
                if getattr(cut, UNFOLLOWED, False):  # found when the pruner was made: not now
                    raise ExportMismatchError(
                        f"the channels coupled to group {group.name!r} cannot be followed in "
                        "the model being exported (the graph maps them past a layer's width); "
                        "the model is unchanged. Leave the group whole with ignored_layers=[...]"
                    )
                cut.prune()
                for conv, weight in grouped.items():
                    cut_grouped_inputs(conv, weight, group.channels(mask.nonzero().flatten()))
                for norm in group.response_norms:  # cut with the channels: rescaled
                    rescaled = names[original_names[norm]]
                    rescale_response_norm(rescaled, group.size, group.size - len(drop))
                if group.rms_norms:  # cut with the channels (or here): rescaled
                    fed = [
                        (names[original_names[n]], names[original_names[f]])
                        for n, f in group.rms_norms
                    ]
                    cut_and_rescale(fed, group.size, mask.nonzero().flatten())
                if group.group_norm is not None:  # whole groups went: as many fewer groups
                    norm = names[original_names[group.group_norm]]
                    norm.num_groups -= len(dropped_units)
        for name, (layout, block_masks) in expert_masks.items():  # after Torch-Pruning's
            prune_experts(names[name], layout, block_masks)
        run_misaligned_experts(pruned, {name: names[name] for name in expert_masks})
        tie_again(tied, pruned)  # the holders of one weight hold one again
        set_model_counts(pruned, self.groups, masks)
        linear_to_conv1d(pruned)  # GPT-2's layers in its own layout again (conv1d.py)
        described = update_config(pruned, [(kind_of(g), g) for g in self.groups], masks)
        if not described and any(getattr(g, "heads_from_config", False) for g in self.groups):
            raise ExportMismatchError(
                "the model's config cannot describe the exported heads (see the warning), "
                "and its attention layers read their head count from it"
            )
        return pruned

    def _check_shared_head_counts(self, masks: list[torch.Tensor]) -> None:
        """Attention layers that read their head count from the config all layers share
        (Phi-3) export only when every one of them keeps the same number of heads."""
        shared = [
            (g, int(m.sum()))
            for g, m in zip(self.groups, masks, strict=True)
            if getattr(g, "heads_from_config", False)
        ]
        if not shared:
            return
        layers = getattr(getattr(self.model, "config", None), "num_hidden_layers", None)
        if len({kept for _, kept in shared}) > 1 or len(shared) != layers:
            counts = {g.name: kept for g, kept in shared}
            raise ExportMismatchError(
                f"attention layers {list(counts)[:4]} read their head count from the "
                "model's config, which all layers share, so every attention layer must keep "
                f"the same number of heads; the masks keep {counts} of {layers} layers. "
                "Give all of them one heads ratio with budget='layer'"
            )

    def _unmasked_copy(self) -> nn.Module:
        return copy.deepcopy(self.model)
