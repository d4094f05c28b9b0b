"""Attention heads tied across the layers of a stack: T5's, MPNet's and LayoutLMv3's
relative position bias.

The first self-attention layer of a T5 stack computes a bias per head from its table
(``relative_attention_bias``) and hands that tensor to every later layer of the stack,
whose head h adds it to its scores; the first cross-attention layer hands on its zero
bias likewise. Removing heads from one of these layers alone would leave it the other
heads' biases. Removing the same heads from every layer of such a chain, with the
table's columns of them, leaves each head its own bias: the chain is one group
(:class:`TiedHeadGroup`), one unit per key/value head, one mask on every layer's output
columns, one transport segment, named after the chain's first layer.

Chains are found in one forward of the example inputs (:func:`tie_chains`): a layer
handed no bias that returns one starts a chain; a layer handed that very tensor belongs
to it. Layers handed one tensor that no such layer returned are a chain too when the
model computes it from tables of one entry per head outside them (MPNet's encoder's
``relative_attention_bias``; LayoutLMv3's three linear layers, summed; the last layer of
timm's shared relative-position MLP), proven in forwards with half the tables' entries
kept (and the head counts of the modules holding them set: heads.table_holders); the
tables lose the removed heads' entries with the layers. A layer handed a bias no
table gives is refused by name, as is a chain whose layers' heads differ; MPT's layers,
handed the ALiBi bias the model computes for all heads, are not chains: export gives
them a class that adds its kept heads' entries (picked_heads.py).
Each layer of a chain is proven as every head group is (heads.py), a later layer with
the bias it is handed cut to the kept heads, as the exported first layer hands it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from .heads import HeadGroup, set_head_count, table_holders
from .picked_heads import picked_argument
from .proof import close, run_watched

# the arguments by which an attention layer is handed the bias of another layer (T5, mT5,
# LongT5, Switch Transformers, Pop2Piano) or of the model (MPNet's, from a table; MPT's
# ALiBi, picked by the layer: picked_heads.py; timm's ViT with a shared relative
# position MLP, `shared_rel_pos`)
BIAS_ARGUMENTS = ("position_bias", "shared_rel_pos")


def bias_argument(module: nn.Module) -> str | None:
    """The argument of BIAS_ARGUMENTS that `module`'s forward takes, or None."""
    parameters = inspect.signature(module.forward).parameters
    return next((name for name in BIAS_ARGUMENTS if name in parameters), None)


@dataclass
class TiedHeadGroup(HeadGroup):
    """The heads of a chain of attention layers that share one bias per head: the
    chain's first layer's fields (its name, projections, table), the same units
    removed from every layer of `tied` (the first included)."""

    tied: list[HeadGroup] = field(default_factory=list)
    # per later layer: the dimension of the heads in the bias it is handed
    bias_dims: dict[nn.Module, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kept_out = [layer for g in self.tied for layer in g.kept_out]
        self.kept_in = [layer for g in self.tied for layer in g.kept_in]
        self.width = {m: w for g in self.tied for m, w in g.width.items()}

    @classmethod
    def of(
        cls,
        chain: list[HeadGroup],
        bias_dims: dict[nn.Module, int],
        sources: list[tuple[nn.Module, str, int]] | None = None,
    ) -> TiedHeadGroup:
        """The group of `chain` (its first layer first), whose layers have equal heads;
        `sources` the tables outside them the bias comes from, if any (MPNet's,
        LayoutLMv3's)."""
        first = chain[0]
        own = {f.name: getattr(first, f.name) for f in fields(HeadGroup) if f.init}
        own["tables"] = [t for g in chain for t in g.tables] + list(sources or [])
        own["row_vectors"] = [v for g in chain for v in g.row_vectors]
        own["rescaled"] = [r for g in chain for r in g.rescaled]
        own["norms"] = tuple(n for g in chain for n in g.norms)
        own["refusal"] = next(
            (f"its tied layer {g.name!r}: {g.refusal}" for g in chain[1:] if g.refusal),
            first.refusal,
        )
        return cls(**own, tied=chain, bias_dims=bias_dims)

    @property
    def members(self) -> list[HeadGroup]:
        return self.tied

    def unit_weights(self) -> torch.Tensor:
        """Every layer's output columns of the unit, side by side (the unit's filter)."""
        return torch.cat([HeadGroup.unit_weights(g) for g in self.tied], dim=1)

    def cut_call(self, member: HeadGroup, call: tuple, keep: torch.Tensor) -> tuple:
        """`member`'s example call with the bias it is handed cut to the query heads of
        the units `keep` (what the exported first layer hands it); the first layer's call
        as it is."""
        dim = self.bias_dims.get(member.module)
        if dim is None:
            return call
        args, kwargs = call
        per_unit = member.query_heads_per_unit
        heads = (keep[:, None] * per_unit + torch.arange(per_unit)).flatten()
        bound = inspect.signature(member.module.forward).bind_partial(*args, **kwargs)
        argument = bias_argument(member.module)
        if argument is None:  # (a member with a bias dim was handed its bias)
            raise RuntimeError(f"{type(member.module).__name__} takes no attention bias")
        bias = bound.arguments[argument]
        bound.arguments[argument] = bias.index_select(dim, heads.to(bias.device))
        return bound.args, bound.kwargs


def _outside_why(group: HeadGroup) -> str:
    """Why `group`'s layer, handed a bias for all heads from outside the chains, is
    refused."""
    return (
        f"its forward takes `{bias_argument(group.module)}`, and the example inputs hand it a "
        "bias for all heads that no attention layer computed and no table of the model gives "
        "head by head (ALiBi computed by the model, where export has no class for the layer "
        "that picks its heads' entries), or none: it would not lose the heads removed from "
        "the layer"
    )


def _heads(group: HeadGroup) -> tuple[int, int, int]:
    return (group.units, group.query_heads_per_unit, group.head_dim)


def _unlike(group: HeadGroup, first: HeadGroup, bias: torch.Tensor, whose: str) -> str:
    """Why `group`, handed the bias `first` computes or is handed (`whose`), is refused:
    its heads are not `first`'s."""
    heads = group.units * group.query_heads_per_unit
    return (
        f"it adds the bias {first.name!r} {whose} for its heads, so its heads are "
        f"tied to that layer's, but its {heads} heads of {group.head_dim} (a bias "
        f"of shape {tuple(bias.shape)}) are not that layer's "
        f"{first.units * first.query_heads_per_unit} of {first.head_dim}"
    )


# the attributes set_head_count may change on a table's holder
HEAD_COUNTS = ("num_heads", "n_heads", "bias_shape")


class _SeenError(Exception):
    """Raised by the hook of `_bias_with_tables_cut` once it has the bias: nothing more runs."""


def _source_tables(
    model: nn.Module, inputs: tuple, chain: list[HeadGroup], bias: torch.Tensor, dim: int
) -> list[tuple[nn.Module, str, int]]:
    """The tables outside the chain's layers, one entry per head, from which the model
    computes the `bias` it hands them, as (module, parameter name, dimension of the
    heads): an embedding of one column per head (MPNet's encoder's
    relative_attention_bias), a linear layer of one output per head, whose weight is
    indexed by bucket (LayoutLMv3's encoder's rel_pos_bias and its 2-D x and y tables,
    summed); [] when none is. Proven in forwards on `inputs` with every other head's
    entries of the tables kept: the bias handed to the chain's first layer must then be
    `bias` with every other head kept along `dim`. One table alone is tried first, then
    all of them, less each whose entries, kept whole, still give that bias (one the bias
    does not read)."""
    first = chain[0]
    heads = first.units * first.query_heads_per_unit
    if heads < 2:  # nothing to prove with one
        return []
    inside = {m for g in chain for m in g.module.modules()}
    candidates: list[list[tuple[nn.Module, str, int]]] = []
    for module in model.modules():
        if module in inside:
            continue
        if isinstance(module, nn.Embedding) and module.embedding_dim == heads:
            candidates.append([(module, "weight", 1)])
        elif isinstance(module, nn.Linear) and module.out_features == heads:
            candidates.append([(module, n, 0) for n, _ in module.named_parameters()])
    keep = torch.arange(0, heads, 2)
    want = bias.index_select(dim, keep.to(bias.device))
    names = {m: n for n, m in model.named_modules()}
    members = [names[g.module] for g in chain]

    def gives_bias(tables: list[tuple[nn.Module, str, int]]) -> bool:
        held = {h for owner, _, _ in tables for h in table_holders(names[owner], members)}
        holders = [model.get_submodule(h) for h in held]
        return _bias_with_tables_cut(
            model, inputs, first.module, tables, keep, want, holders, heads
        )

    for tables in candidates:
        if gives_bias(tables):
            return tables
    if len(candidates) < 2:
        return []
    chosen = list(candidates)
    if not gives_bias([t for tables in chosen for t in tables]):
        return []
    for tables in list(chosen):
        rest = [t for other in chosen if other is not tables for t in other]
        if gives_bias(rest):
            chosen.remove(tables)
    return [t for tables in chosen for t in tables]


def _bias_with_tables_cut(
    model: nn.Module,
    inputs: tuple,
    first: nn.Module,
    tables: list[tuple[nn.Module, str, int]],
    keep: torch.Tensor,
    want: torch.Tensor,
    holders: list[nn.Module],
    heads: int,
) -> bool:
    """Whether, with `tables`' entries cut to the heads `keep` (and the head counts of
    their `holders` with them, as export sets them), the model hands `first` the bias
    `want`; the model runs until `first` is called, the tables and counts restored
    after."""
    seen = []
    counts = [(h, {a: getattr(h, a) for a in HEAD_COUNTS if hasattr(h, a)}) for h in holders]
    for holder, _ in counts:
        set_head_count(holder, heads, len(keep))

    def stop(module, args, kwargs):
        given = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        seen.append(given.get(bias_argument(module)))
        raise _SeenError

    whole = [getattr(owner, name) for owner, name, _ in tables]
    for (owner, name, dim), param in zip(tables, whole, strict=True):
        setattr(owner, name, nn.Parameter(param.detach().index_select(dim, keep.to(param.device))))
    try:
        run_watched(model, inputs, [first.register_forward_pre_hook(stop, with_kwargs=True)])
    # _SeenError once the bias is seen; any other: the model fails with the tables cut
    except Exception:  # `seen` tells which
        pass
    finally:
        for (owner, name, _), param in zip(tables, whole, strict=True):
            setattr(owner, name, param)
        for holder, saved in counts:
            for attribute, value in saved.items():
                setattr(holder, attribute, value)
    got = seen[0] if seen else None
    # close, not equal: a linear table's outputs round apart in a narrower product
    return isinstance(got, torch.Tensor) and got.shape == want.shape and close(got, want)


def _bias_dim(bias: torch.Tensor, heads: int) -> int | None:
    """The dimension of the heads in a bias handed to a layer of `heads` query heads: 1
    in the (batch, heads, queries, keys) layout of attention scores, else the one
    dimension of that size (LongT5's blocks); None when none is."""
    if bias.dim() > 1 and bias.shape[1] == heads:
        return 1
    sized = [d for d, size in enumerate(bias.shape) if size == heads]
    return sized[0] if len(sized) == 1 else None


def tie_chains(model: nn.Module, groups: list[HeadGroup], inputs: tuple) -> list[HeadGroup]:
    """`groups` with the layers of each chain (see the module's docstring) replaced by
    one TiedHeadGroup where its first layer stood; a layer handed a bias from outside
    any chain refused by name. Runs the model once on `inputs`, only when a layer takes
    the bias argument."""
    takers = [
        g
        for g in groups
        if not g.refusal
        and bias_argument(g.module) is not None
        and picked_argument(g.module) != bias_argument(g.module)  # MPT's, WavLM's pick theirs
    ]
    if not takers:
        return groups
    names = {m: n for n, m in model.named_modules()}
    receivers = [m for m in names if bias_argument(m) is not None]
    handed, returned = _watch(model, inputs, receivers)
    # the tensors each layer handed no bias returned, by identity (`returned` holds them)
    firsts = {
        id(out): g for g in takers if handed.get(g.module, 0) is None for out in returned[g.module]
    }
    chains: dict[nn.Module, list[HeadGroup]] = {}  # by the first layer's module
    bias_dims: dict[nn.Module, dict[nn.Module, int]] = {}
    # each bias handed from outside, by identity, and the layers handed it
    outside: dict[int, tuple[torch.Tensor, list[HeadGroup]]] = {}
    for group in takers:
        bias = handed.get(group.module, 0)  # 0: never called
        if bias is None:
            chains.setdefault(group.module, [group])
            continue
        if not isinstance(bias, torch.Tensor):
            group.refusal = _outside_why(group)
            continue
        first = firsts.get(id(bias))
        if first is None:
            outside.setdefault(id(bias), (bias, []))[1].append(group)
            continue
        dim = _bias_dim(bias, group.units * group.query_heads_per_unit)
        if dim is None or _heads(group) != _heads(first):
            group.refusal = _unlike(group, first, bias, "computes")
            continue
        chains.setdefault(first.module, [first]).append(group)
        bias_dims.setdefault(first.module, {})[group.module] = dim
    sources = {}  # per first layer of a chain handed a bias from outside: its tables
    for bias, chain in outside.values():
        first = chain[0]
        found = {g.module: _bias_dim(bias, g.units * g.query_heads_per_unit) for g in chain}
        dims = {module: dim for module, dim in found.items() if dim is not None}
        unlike = [g for g in chain if _heads(g) != _heads(first)]
        source = []
        if not unlike and len(dims) == len(found):
            source = _source_tables(model, inputs, chain, bias, dims[first.module])
        if not source:
            for group in chain:
                group.refusal = _outside_why(group)
                if any(g is group for g in unlike):
                    group.refusal = _unlike(group, first, bias, "is handed")
            continue
        chains[first.module], bias_dims[first.module] = chain, dims
        sources[first.module], firsts[id(bias)] = source, first
    _refuse_chains_reaching_others(chains, firsts, handed, names)
    tied = {
        module: TiedHeadGroup.of(chain, bias_dims[module], sources.get(module))
        for module, chain in chains.items()
        if len(chain) > 1 or module in sources
    }
    later = {m.module for chain in chains.values() for m in chain[1:]}
    return [tied.get(g.module, g) for g in groups if g.module not in later]


def _refuse_chains_reaching_others(
    chains: dict[nn.Module, list[HeadGroup]],
    firsts: dict[int, HeadGroup],
    handed: dict[nn.Module, object],
    names: dict[nn.Module, str],
) -> None:
    """Refuse each chain whose first layer's bias is handed to a module holding no layer
    of the chain it reaches (T5's blocks hold theirs): a layer left whole (ignored, or
    not in a recognised form) that export would hand a bias of fewer heads."""
    layers = {m.module for chain in chains.values() for m in chain}
    left: dict[nn.Module, list[nn.Module]] = {}  # per first layer: the modules left whole
    for module, bias in handed.items():
        first = firsts.get(id(bias)) if isinstance(bias, torch.Tensor) else None
        if first is None or module in layers or first.module not in chains:
            continue
        if not any(m in layers and handed.get(m) is bias for m in module.modules()):
            left.setdefault(first.module, []).append(module)
    for first_module, modules in left.items():
        first = chains[first_module][0]
        # the innermost: the attention layer itself, not the block holding it
        inner = next(m for m in modules if not any(o in modules for o in m.modules() if o is not m))
        first.refusal = first.refusal or (
            f"the bias per head it computes is handed to {names[inner]!r} too, which is "
            "left whole (ignored, or not an attention layer in a form the pruner knows): "
            "removing heads from the chain would hand it a bias of fewer heads"
        )


def _watch(
    model: nn.Module, inputs: tuple, modules: list[nn.Module]
) -> tuple[dict[nn.Module, object], dict[nn.Module, list[torch.Tensor]]]:
    """For each of `modules`, at its first call in one eval forward on `inputs`: the bias
    argument it was handed (a tensor, or None) and the tensors it returned."""
    handed: dict[nn.Module, object] = {}
    returned: dict[nn.Module, list[torch.Tensor]] = {}

    def before(module, args, kwargs):
        if module not in handed:
            given = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            handed[module] = given.get(bias_argument(module))

    def after(module, _args, _kwargs, output):
        if module not in returned:
            items = output if isinstance(output, tuple) else (output,)
            returned[module] = [t for t in items if isinstance(t, torch.Tensor)]

    handles = [m.register_forward_pre_hook(before, with_kwargs=True) for m in modules]
    handles += [m.register_forward_hook(after, with_kwargs=True) for m in modules]
    run_watched(model, inputs, handles)
    return handed, returned
