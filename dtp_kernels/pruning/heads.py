"""Attention-head groups: one segment over the heads of an attention layer.

The layers are recognised by their form (attention_forms.py: Torch-Pruning's graph does
not follow the per-head reshapes), each giving a group of its heads (head_group.py).

Some are found only to be refused by name when their heads are asked for: layers handed
a bias for all heads computed outside them, which would not lose the removed heads,
unless export gives them a class that adds its kept heads' entries of it (ALiBi:
BLOOM's, MPT's, Falcon's; WavLM's relative position bias; picked_heads.py). T5's
layers, handed the relative position bias the first layer of their stack computes, are
one group with that layer, and MPNet's, handed the one their encoder computes from
its table, one group with that table (tied_heads.py).

The unit is a key/value head together with the query heads that share it (grouped-query
attention; one query head per unit without it); in multi-query attention, one key/value
head for all, the unit is a query head and the key and value stay whole. Removing a
unit removes its query, key and value rows and the output projection's input columns of
its query heads; the heads left attend exactly as before, so masking those output
columns per unit is exactly what removing the unit does. Every head group asked to be
pruned is proven so on its example input before any mask (:func:`prove_head_groups`,
proof.py), and refused by name when its layer's code treats the heads otherwise. A
layer whose code reshapes its output to its own ``embed_dim`` (XGLM's) is proven, where
the plain cut fails, with that attribute set to the kept width, which export then writes.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from .attention_forms import match_form
from .cost import run_hooked
from .cuts import (
    as_linear,
    cut_batch_norm,
    cut_depthwise,
    cut_diagonal_columns,
    cut_linear,
    of_kind,
)
from .grouped_convs import ratios_keeping_parts_alike
from .groups import is_norm
from .head_group import HeadGroup, Projection
from .head_norms import (
    RescaledNorm,
    cut_norm,
    fed_norms,
    norms_after_output,
    norms_over_all_heads,
    norms_read_by,
    rescales_exactly,
)
from .module_tensors import tensor_of
from .multihead_attention import PrunedMultiheadAttention
from .picked_heads import PicksItsHeads, keep_heads, picked_argument, picking_submodules
from .proof import cuts_exactly, dropped, example_calls
from .pruned_classes import pruned_classes
from .ratios import kept_count


def find_head_groups(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple = ()
) -> list[HeadGroup]:
    """Every attention layer of these forms, in model order; an error names one whose
    projections do not split into whole heads. `inputs` (the example inputs) show which
    layers are handed a bias for their heads from outside (see `_biases_from_outside`)."""
    modules = dict(model.named_modules())
    groups = []
    for name, module in model.named_modules():
        if module in ignored:
            continue
        group = match_form(name, module)
        if group is None or any(layer in ignored for layer in [*group.kept_out, group.layer]):
            continue
        if group.refusal:  # not split into heads: refused when asked for, nothing to find
            groups.append(group)
            continue
        group.per_head_layers = _per_head_layers(group)
        if not group.latent:  # a latent's norms act before the heads' own projections
            group.norms = norms_over_all_heads(group.module, group.head_dim)
            group.head_mixers = _head_mixers(group)
        group.refusal = group.refusal or _other_linears(group)
        group.__post_init__()
        parent = group.name.rpartition(".")[0]  # the block holding the attention layer
        group.tables, mixed = _per_head_tables(group, modules[parent] if parent else None)
        whole = picking_submodules(group.module, "whole")  # serving all the model's heads
        group.tables = [t for t in group.tables if t[0] not in whole]
        group.row_vectors = _row_vectors(group)
        group.refusal = group.refusal or mixed
        groups.append(group)
    outside = _biases_from_outside(model, inputs, [g for g in groups if not g.refusal])
    for group in groups:
        group.refusal = group.refusal or outside.get(group.module, "")
    normed = [g for g in groups if g.norms and not g.refusal]
    if normed and inputs:  # a norm of the layer's input or output is no norm over its heads
        before = norms_read_by(model, inputs, {n: g.kept_out for g in normed for n in g.norms})
        after = norms_after_output(model, inputs, {n: g.out.layer for g in normed for n in g.norms})
        for group in normed:
            group.norms = tuple(n for n in group.norms if n not in before | after)
    _rescale_norms(model, inputs, [g for g in groups if g.norms and not g.refusal])
    return groups


def _per_head_layers(group: HeadGroup) -> list[nn.Module]:
    """The depthwise convolutions inside `group`'s attention layer over its head size
    (MViT's pooling of the queries, keys and values) and the layers its picking class
    runs per kept head (WavLM's gate): they run on each head apart."""
    return [
        m
        for m in group.module.modules()
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        and m.in_channels == m.out_channels == m.groups == group.head_dim
        and group.head_dim > 1
    ] + picking_submodules(group.module, "per_head")


def check_shard_ratios(groups: list, ratios: dict[str, float], budget: str) -> None:
    """ValueError, before any mask, when heads kept alike in equal groups (CodeGen's
    shards, DeepSeek-V4's output groups) are asked to go under a budget other than
    "layer", or at a count the groups cannot keep alike."""
    sharded = [
        g
        for g in groups
        if isinstance(g, HeadGroup) and g.segments > 1 and ratios[g.name] > 0 and not g.refusal
    ]
    if not sharded:
        return
    if budget != "layer":
        raise ValueError(
            f"budget = {budget!r} cannot keep the same number of heads in each group of "
            f"attention layer {sharded[0].name!r} (and {len(sharded) - 1} more), which its "
            "code needs; use budget='layer', or leave them whole with ignored_layers=[...] or "
            "a ratio of 0 for them"
        )
    uneven = [g for g in sharded if kept_count(g.size, ratios[g.name]) % g.segments]
    if uneven:
        details = "; ".join(
            f"attention layer {g.name!r}: ratio {ratios[g.name]} keeps "
            f"{kept_count(g.size, ratios[g.name])} of {g.size} heads in {g.segments} groups of "
            f"{g.size // g.segments}"
            for g in uneven[:4]
        )
        common = ratios_keeping_parts_alike({g.size // g.segments for g in uneven})
        raise ValueError(
            f"these attention layers keep the same number of heads in each of their groups "
            f"(CodeGen's shards, DeepSeek-V4's output groups), so a kept count must be a "
            f"multiple of the groups: {details}. Ratios every one "
            f"of these layers can keep: {common}"
        )


def _rescale_norms(model: nn.Module, inputs: tuple, groups: list[HeadGroup]) -> None:
    """Move each norm of `groups` that normalizes one projection's output as it is (seen
    in one forward on `inputs`) and stays exact cut and rescaled (an RMS norm) from the
    group's refused `norms` to its `rescaled`."""
    candidates = {
        norm: [(p.layer, p.per_unit) for p in g.rows if p.blocks == 1 and not p.shared_rows]
        for g in groups
        for norm in g.norms
    }
    if not candidates or not inputs:
        return
    fed = fed_norms(model, inputs, candidates)
    # a norm of the attention output, where a value projection of its own holds the
    # units' rows: masked and rescaled there (head_norms.py)
    valued = {n: g.out.layer for g in groups if _value(g) is not None for n in g.norms}
    after = norms_read_by(model, inputs, {n: [o] for n, o in valued.items() if n not in fed})
    for group in groups:
        exact = [n for n in group.norms if n in fed and rescales_exactly(n)]
        group.rescaled = [RescaledNorm(n, *fed[n]) for n in exact]
        value = _value(group)
        for norm in group.norms:
            if norm in after and value is not None and rescales_exactly(norm):
                group.rescaled.append(
                    RescaledNorm(norm, value.layer, value.per_unit, group.out.per_unit)
                )
                exact.append(norm)
        group.norms = tuple(n for n in group.norms if n not in exact)


def _value(group: HeadGroup) -> Projection | None:
    """`group`'s value projection when it is a layer of its own, one row block per unit
    (separate query, key and value projections, in that order), else None."""
    if len(group.rows) != 3:  # multi-query attention shares its value head: only the query
        return None
    value = group.rows[2]
    if (
        value.blocks != 1
        or value.shared_rows
        or any(p.layer is value.layer for p in group.rows[:2])
    ):
        return None
    return value


def _proof_scope(group: HeadGroup, model: nn.Module) -> nn.Module | None:
    """The module a proof of `group` runs: its attention layer, or the block holding it
    when a table or the output projection lies beside it (BERT's output.dense, BEiT's
    bias table); None where no proof is made: torch's MultiheadAttention (replaced at
    export), a head count read from the shared config (Phi-3), a table further out, or a
    single unit."""
    if isinstance(group.module, nn.MultiheadAttention) or group.heads_from_config:
        return None
    if group.units < 2:
        return None
    needed = {group.out.layer, *(p.layer for p in group.rows), *(o for o, _, _ in group.tables)}
    names = {m: n for n, m in model.named_modules()}
    name = names[group.module]
    for scope_name in (name, name.rpartition(".")[0]):
        scope = model.get_submodule(scope_name)
        if needed <= set(scope.modules()):
            return scope if scope is not model else None
    return None


def prove_head_groups(model: nn.Module, groups: list[HeadGroup], inputs: tuple) -> None:
    """Refuse each of `groups` (the heads to prune) whose attention layer, with half its
    units removed as export removes them, does not compute on its example input what it
    computes with their output columns zeroed as the hard mask zeroes them (proof.py):
    a head form the layer's code does not follow (a differential attention pairing its
    heads, a projection of the heads' width the forms do not know). Every layer of a
    chain tied by its bias (tied_heads.py) is proven so, the chain refused naming the
    layer that fails."""
    scopes = [
        (g, m, s) for g in groups for m in g.members if (s := _proof_scope(m, model)) is not None
    ]
    calls = example_calls(model, list({id(s): s for _, _, s in scopes}.values()), inputs)
    for tied, group, scope in scopes:
        if scope not in calls or tied.refusal:
            continue  # never ran on the example (export's check still runs), or refused
        names = {m: n for n, m in scope.named_modules()}

        def zero(copy: nn.Module, keep: torch.Tensor, group=group, names=names) -> None:
            out = tensor_of(copy.get_submodule(names[group.out.layer]))
            units = dropped(group.units, keep, torch.device("cpu"))
            if group.out.diagonal > 1:  # a unit's columns in its own run's rows
                blocks = group.out.unit_block(out, group.units)
                run = group.units // group.out.diagonal
                for unit in units.tolist():
                    blocks[unit // run, :, unit % run] = 0
            else:
                out[:, group.out.kept(group.units, units).to(out.device)] = 0
            for mixer in group.head_mixers:  # the columns of the heads' mixes too
                weight = tensor_of(copy.get_submodule(names[mixer]))
                weight[:, units.to(weight.device)] = 0
            for rescaled in group.rescaled:  # the hard mask zeroes their rows too
                rows = copy.get_submodule(names[rescaled.rows])
                removed = Projection(rows, 1, rescaled.per_unit).kept(group.units, units)
                for name in ("weight", "bias"):
                    tensor = getattr(rows, name, None)
                    if isinstance(tensor, torch.Tensor):
                        tensor[removed.to(tensor.device)] = 0

        def cut(copy: nn.Module, keep: torch.Tensor, group=group, names=names) -> None:
            mask = torch.zeros(group.units)
            mask[keep] = 1
            prune_heads(group, dict(copy.named_modules()), names, mask)

        # a layer of a chain is handed the bias cut as the exported first layer hands it
        if not _proven(group, scope, calls[scope], zero, cut, partial(tied.cut_call, group)):
            where = "" if group.module is tied.module else f"its tied layer {group.name!r}: "
            tied.refusal = where + (
                "with some of its heads removed it does not compute what it computes with "
                "them masked, on the example inputs: its code treats its heads in a way "
                "the head forms do not know (a differential attention pairing them, a "
                "projection of their width, a reshape to the model width, a table of "
                "them shared by all layers)"
            )


# attributes an attention layer's code may reshape its output to, holding the query width
# (the model width as it is built): XGLM's, MVP's, InternVL's vision tower's; timm's
# Hiera's `dim_out`, Hugging Face Hiera's `hidden_size_output`; DBRX's `hidden_size`,
# where it splits its fused projection's queries from the keys
OUTPUT_WIDTH_ATTRIBUTES = (
    "embed_dim",
    "dim_out",
    "hidden_size_output",
    "output_dim",
    "hidden_size",
)


def _proven(group: HeadGroup, scope: nn.Module, call: tuple, zero, cut, cut_call) -> bool:
    """Whether cutting `group`'s units computes what zeroing them does on `call`: as
    export cuts them, or else with the layer's attribute of the output width rewritten
    (which `group.output_width` then names for export), or else with its vectors of the
    query width left whole (one of the model width, as wide where the two widths are
    equal: GPT-NeoX Japanese's `dense_bias`, added after the output projection). Each
    is tried only where the ones before fail, so a layer whose code reads the attribute
    as the model width is left as it is."""
    per_unit = (1, group.query_heads_per_unit)  # key/value heads, query heads
    exact = partial(
        cuts_exactly,
        first_output=True,
        cut_call=cut_call,
        per_unit=per_unit,
        segments=group.segments,
    )
    if exact(scope, call, group.units, zero, cut):
        return True
    width = group.units * group.query_heads_per_unit * group.head_dim
    for attribute in OUTPUT_WIDTH_ATTRIBUTES:
        if getattr(group.module, attribute, None) != width:
            continue
        group.output_width = attribute
        if exact(scope, call, group.units, zero, cut):
            return True
        group.output_width = ""
    if group.row_vectors:
        vectors, group.row_vectors = group.row_vectors, []
        if exact(scope, call, group.units, zero, cut):
            return True
        group.row_vectors = vectors
    return False


# an attention layer's linear layer of the query width that gates the attention output
# channel by channel before the output projection (AFMoE's, Beam's; timm EVA's `gate`)
OUTPUT_GATES = ("gate_proj", "gate")
# an attention layer's linear layer of the query width that projects the relative
# position embeddings head by head (Wav2Vec2-Conformer's, Transformer-XL style)
POSITION_PROJECTIONS = ("linear_pos",)


def _head_mixers(group: HeadGroup) -> list[nn.Linear]:
    """The attention layer's linear layers with one input and one output per head (CaiT's
    talking heads), where every unit is one head."""
    heads = group.units * group.query_heads_per_unit
    if group.query_heads_per_unit != 1 or heads < 2:
        return []
    known = {group.out.layer, *(p.layer for p in group.rows)}
    return [
        child
        for child in group.module.children()
        if isinstance(child, nn.Linear)
        and child not in known
        and child.in_features == child.out_features == heads
    ]


def _other_linears(group: HeadGroup) -> str:
    """Add the attention layer's output gate and relative-position projection to
    `group`'s rows; why another linear layer of the layer's that computes the query
    width from the layer's input refuses it, or ""."""
    width = group.units * group.query_heads_per_unit * group.head_dim  # the query width
    known = {group.out.layer, *(p.layer for p in group.rows)}
    # the layer's input: a latent attention's query rows read the compressed query, the
    # output projection writes the model width its input has (HunYuan V4's output gate)
    given: int | None
    if group.latent:
        given = as_linear(group.out.layer).out_features
    else:  # torch's MultiheadAttention is its own row projection: it has no in_features
        given = getattr(group.rows[0].layer, "in_features", None)
    for name, child in group.module.named_children():
        if (
            not isinstance(child, nn.Linear)
            or child in known
            or child.out_features != width
            or child.in_features != given
        ):
            continue
        if name not in (*OUTPUT_GATES, *POSITION_PROJECTIONS):
            return (
                f"its linear layer {name!r} computes the query width ({width}) from the "
                "layer's input for a use the head forms do not know, so removing heads "
                "would leave it the wrong size"
            )
        group.add_rows(Projection(child, 1, group.query_heads_per_unit * group.head_dim))
    return ""


# the arguments by which attention layers receive a bias per head computed outside them
# (ALiBi; BLOOM's and Falcon's layers export gives a class picking their heads' entries)
# when the example inputs hand them a tensor (T5's `position_bias`, and MPT's:
# tied_heads.py)
WHEN_GIVEN = ("alibi",)


def _biases_from_outside(
    model: nn.Module, inputs: tuple, groups: list[HeadGroup]
) -> dict[nn.Module, str]:
    """The attention layers (of `groups`) handed a bias per head from outside, with why
    that refuses them. The model runs once on `inputs`, only when a layer may receive
    one."""
    found: dict[nn.Module, str] = {}
    watched: dict[nn.Module, list[str]] = {}
    for group in groups:
        forward = inspect.signature(group.module.forward).parameters
        # a layer export gives a class that picks its heads' entries is not refused (as
        # nn.MultiheadAttention's export picks its heads' masks from a mask per head)
        given = [a for a in WHEN_GIVEN if a in forward and a != picked_argument(group.module)]
        if given:
            watched[group.module] = given
    if not watched or not inputs:
        return found

    def record(module, args, kwargs):
        # the arguments by name: positional ones in the order forward declares them
        names = inspect.signature(module.forward).parameters
        given = dict(zip(names, args, strict=False)) | kwargs
        for argument in watched[module]:
            if isinstance(given.get(argument), torch.Tensor):
                found[module] = (
                    f"its forward is handed `{argument}`, a bias per head computed outside "
                    "the layer for all the model's heads (ALiBi), and export has no class "
                    "for the layer that picks its heads' entries: it would not lose the "
                    "heads removed from one layer"
                )

    run_hooked(
        model, inputs, [m.register_forward_pre_hook(record, with_kwargs=True) for m in watched]
    )
    return found


# modules whose parameters are never per-head tables of an attention layer they are beside
NOT_TABLES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.MultiheadAttention)
# layers inside an attention layer whose parameters are never its per-head tables (an
# embedding of one column per head is found apart)
CONVS_AND_EMBEDDINGS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def _per_head_tables(
    group: HeadGroup, block: nn.Module | None
) -> tuple[list[tuple[nn.Module, str, int]], str]:
    """Parameters with one entry per query head along one dimension, besides the
    projections, as (owner module, name, dimension): export cuts them to the kept heads.
    They are looked for in the attention layer (Swin's relative position bias table, the
    rows of Swin V2's per-head bias MLP output) and, as raw parameters, in the block
    holding it and its direct children that hold no linear layer (BEiT's bias table; not
    an MLP or a mixture of experts, whose per-expert biases may have as many entries as
    there are heads: AFMoE's; not deeper, where experts keep their raw weights). A
    parameter with several such dimensions (heads mixed with heads) makes the second
    item say why the heads cannot be pruned ("" when they can)."""
    heads = group.units * group.query_heads_per_unit
    projections = {*group.kept_out, group.layer}
    candidates: list[tuple[nn.Module, str, str, torch.Tensor]] = []  # (owner, its name, ...)
    # an embedding of one column per head (T5's relative position bias of a few dozen
    # buckets: their number may equal the heads')
    tables: list[tuple[nn.Module, str, int]] = [
        (owner, "weight", 1)
        for owner in group.module.modules()
        if isinstance(owner, nn.Embedding) and owner.embedding_dim == heads
    ]
    for owner_name, owner in group.module.named_modules():
        if owner in projections or is_norm(owner) or isinstance(owner, CONVS_AND_EMBEDDINGS):
            continue  # a conv's kernel may be as wide as there are heads (SegFormer's)
        if isinstance(owner, nn.Linear):  # a layer computing one output per head
            if owner.out_features == heads:
                candidates += [(owner, owner_name, n, p) for n, p in owner.named_parameters()]
            continue
        candidates += [(owner, owner_name, n, p) for n, p in owner.named_parameters(recurse=False)]
    inside = set(group.module.modules())
    beside = [("", block), *block.named_children()] if block is not None else []
    for owner_name, owner in beside:
        if owner in inside or isinstance(owner, NOT_TABLES) or is_norm(owner):
            continue
        if owner_name and any(isinstance(m, nn.Linear) for m in owner.modules()):
            continue  # an MLP or a mixture of experts beside the attention layer
        candidates += [(owner, owner_name, n, p) for n, p in owner.named_parameters(recurse=False)]
    mixed = []
    for owner, owner_name, name, p in candidates:
        if owner is group.module and name in group.shared_parameters:
            continue
        if p.shape.count(heads) == 1:
            tables.append((owner, name, p.shape.index(heads)))
        elif p.shape.count(heads) > 1:
            mixed.append(f"{owner_name}.{name} {tuple(p.shape)}".lstrip("."))
    if mixed:
        return tables, (
            f"its {', '.join(mixed)} has a dimension of heads more than once (heads mixed "
            "with heads), so removing a head would change the others"
        )
    return tables, ""


def _row_vectors(group: HeadGroup) -> list[tuple[nn.Module, str]]:
    """The attention layer's own 1-D parameters of the query width (a bias per query row
    kept outside the projection: timm EVA's and BEiT's `q_bias`, `v_bias`)."""
    width = group.units * group.query_heads_per_unit * group.head_dim
    return [
        (group.module, name)
        for name, p in group.module.named_parameters(recurse=False)
        if p.dim() == 1 and len(p) == width
    ]


def prune_heads(
    group: HeadGroup, copy: dict[str, nn.Module], names: dict[nn.Module, str], mask: torch.Tensor
) -> None:
    """Remove the units whose mask is 0 from a copy of the model, in place, in every layer
    of the group. `copy` maps the copy's module names to its modules; `names` the
    original modules to their names."""
    for member in group.members:
        _prune_layer_heads(member, copy, names, mask)
    own = [t for t in group.tables if not any(t in m.tables for m in group.members)]
    if own:  # a table outside every layer (MPNet's encoder's bias table: tied_heads.py)
        query_heads = _query_heads(mask, group.query_heads_per_unit)
        _cut_tables(own, copy, names, query_heads)
        members = [names[m.module] for m in group.members]
        heads = group.units * group.query_heads_per_unit
        for owner, _, _ in own:  # the head counts the table's holders keep
            for holder in table_holders(names[owner], members):
                set_head_count(copy[holder], heads, len(query_heads))


def table_holders(owner: str, members: list[str]) -> list[str]:
    """The names of the modules holding a table outside the attention layers `members`
    (by module name) whose head counts go with it: its owner's parent (MPNet's encoder,
    its n_heads; "", the model, for a table of its own), and every module above that
    parent, below the model, that holds none of the layers (timm's RelPosMlp above its
    MLP's last layer: its num_heads and bias_shape)."""
    name = owner.rpartition(".")[0]
    holders = [name]
    while "." in name:
        name = name.rpartition(".")[0]
        if any(m == name or m.startswith(name + ".") for m in members):
            break
        holders.append(name)
    return holders


def set_head_count(owner: nn.Module, heads: int, kept: int) -> None:
    """The head count a module of an attention layer keeps of its own, `num_heads` (or
    `n_heads`) and the head entry (last, or else first) of `bias_shape` (timm's relative-position
    modules, which shape their bias by it), set from `heads` to `kept`."""
    for count in ("num_heads", "n_heads"):
        if getattr(owner, count, None) == heads:
            setattr(owner, count, kept)
    shape = getattr(owner, "bias_shape", None)
    # (setattr: mypy types a module's attributes as tensors or modules)
    if isinstance(shape, tuple) and shape and shape[-1] == heads:
        setattr(owner, "bias_shape", (*shape[:-1], kept))  # noqa: B010
    elif isinstance(shape, tuple) and shape and shape[0] == heads:
        setattr(owner, "bias_shape", (kept, *shape[1:]))  # noqa: B010


def _query_heads(mask: torch.Tensor, per_unit: int) -> torch.Tensor:
    """The query heads of the units `mask` keeps, in order (on the CPU)."""
    kept = mask.nonzero().flatten().cpu()
    return (kept[:, None] * per_unit + torch.arange(per_unit)).flatten()


def _cut_tables(
    tables: list[tuple[nn.Module, str, int]],
    copy: dict[str, nn.Module],
    names: dict[nn.Module, str],
    query_heads: torch.Tensor,
) -> None:
    """Cut each (owner, name, dim) table of the copy to the entries of `query_heads`."""
    for owner, name, dim in tables:
        target = copy[names[owner]]
        table = getattr(target, name).detach()
        kept_entries = table.index_select(dim, query_heads.to(table.device)).clone()
        setattr(target, name, nn.Parameter(kept_entries))
        if isinstance(target, nn.Linear) and name == "weight":  # one output per head
            target.out_features = len(query_heads)
        if isinstance(target, nn.Embedding):  # one column per head
            target.embedding_dim = len(query_heads)


def _prune_layer_heads(
    group: HeadGroup, copy: dict[str, nn.Module], names: dict[nn.Module, str], mask: torch.Tensor
) -> None:
    """prune_heads for one attention layer."""
    kept = mask.nonzero().flatten().cpu()
    per_unit = group.query_heads_per_unit
    query_heads = _query_heads(mask, per_unit)
    if picked_argument(copy[names[group.module]]):  # picking its heads: before counts change
        keep_heads(copy[names[group.module]], query_heads)
    _cut_tables(group.tables, copy, names, query_heads)
    for inner in copy[names[group.module]].modules():  # its position-bias modules' counts
        set_head_count(inner, group.units * per_unit, len(query_heads))
    query_rows = Projection(group.module, 1, per_unit * group.head_dim).kept(group.units, kept)
    for owner, name in group.row_vectors:
        vector = getattr(copy[names[owner]], name).detach()
        setattr(copy[names[owner]], name, nn.Parameter(vector[query_rows.to(vector.device)]))
    if isinstance(group.module, nn.MultiheadAttention):  # replaced: its width is fixed
        parent, _, attr = names[group.module].rpartition(".")
        source = of_kind(copy[names[group.module]], nn.MultiheadAttention)
        rows = group.rows[0].kept(group.units, kept)
        cut_linear(source.out_proj, group.out.kept(group.units, kept), dim=1)
        setattr(copy[parent], attr, PrunedMultiheadAttention(source, rows, query_heads))
        return
    for projection in group.rows:
        cut_linear(as_linear(copy[names[projection.layer]]), projection.kept(group.units, kept))
    out, out_layer = group.out, as_linear(copy[names[group.out.layer]])
    if out.diagonal > 1:
        cut_diagonal_columns(out_layer, out.diagonal, out.per_unit, group.units, kept)
    else:
        cut_linear(out_layer, out.kept(group.units, kept), dim=1)
    for rescaled in group.rescaled:  # their rows are cut: the norms follow, rescaled
        channels = Projection(rescaled.norm, 1, rescaled.channels_per_unit).kept(group.units, kept)
        cut_norm(copy[names[rescaled.norm]], as_linear(copy[names[rescaled.rows]]), channels)
    for conv in group.convs:
        cut_depthwise(of_kind(copy[names[conv.layer]], _ConvNd), conv.kept(group.units, kept))
    for norm in group.row_norms:
        cut_batch_norm(of_kind(copy[names[norm.layer]], _BatchNorm), norm.kept(group.units, kept))
    for mixer in group.head_mixers:  # one head per unit (_head_mixers)
        cut_linear(as_linear(copy[names[mixer]]), kept)
        cut_linear(as_linear(copy[names[mixer]]), kept, dim=1)
    cache = getattr(copy[names[group.module]], "attention_bias_cache", None)
    if isinstance(cache, dict):  # timm's cache of its per-head bias table, of the old heads
        cache.clear()
    if group.attributes:  # the layer's own sizes
        for attr, per_unit in group.attributes.items():
            setattr(copy[names[group.module]], attr, len(kept) * per_unit)
        return
    # the attributes implementations read (the others reshape with -1)
    heads = len(kept) * group.query_heads_per_unit
    module = copy[names[group.module]]
    sizes = {
        "num_heads": heads,
        "n_heads": heads,
        "n_head": heads,  # OpenAI GPT's
        "heads": heads,  # timm's Hiera
        "num_attention_heads": heads,
        "attn_dim": heads * group.head_dim,
        "all_head_size": heads * group.head_dim,
        "split_size": heads * group.head_dim,
        "inner_dim": heads * group.head_dim,
    }
    if group.output_width:
        sizes[group.output_width] = heads * group.head_dim
    if group.shared_kv:  # the one key/value head stays; it serves fewer query heads
        sizes["num_key_value_groups"] = heads
    else:
        kv_heads = len(kept) * group.kv_heads_per_unit
        sizes |= {
            "num_key_value_heads": kv_heads,
            "num_kv_heads": kv_heads,
            "kv_heads": kv_heads,
            "kv_dim": kv_heads * group.head_dim,
        }
    for attr, value in sizes.items():
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, value)
    pruned_class = pruned_classes().get(type(module))
    # its code ties the head size to the model width (one picking its heads' entries of a
    # bias is given above)
    if pruned_class is not None and not issubclass(pruned_class, PicksItsHeads):
        pruned_class.from_dense(module)
