"""Weights that several modules hold (tied): groups that cut them pruned with one mask,
groups that would untie them refused, and the export tied again.

A model may hold one parameter in several modules: an output layer tied to the
embedding, or one block reused by several layers as separate modules holding the same
tensors (Zamba's and Zamba2's shared transformer blocks, built per hybrid layer and
tied). Cutting one holder of such a weight and not the others would untie them: the
export would hold copies where the model held one tensor, more parameters than the
report counts, and a structure its config cannot describe.

- Attention layers whose projections are all the same tensors, in the same order
  (:func:`tie_weight_sharing_heads`), and which hold nothing per head besides them, are
  one group: one mask on every layer, the same heads removed from each
  (:class:`~dtp_kernels.pruning.tied_heads.TiedHeadGroup`, handed no bias).
- Other groups that cut one tensor in different modules the example forward runs are a
  tie set (:func:`tie_sets`): the pruner gives each group of a set the first one's mask
  (``mask_of``), so each holder is cut alike.
- A group cutting a weight that a module outside its set holds and runs is refused, by
  name (:func:`held_elsewhere`); a holder that never runs is handed the cut tensor.
- Export cuts each holder alike; :func:`tie_again` then gives every holder of a weight
  the copy held once (:func:`holders`, before the cut) the one cut tensor, and refuses
  an export where the cut holders differ. The cost model counts a tensor once, with its
  first holder (:func:`weight_copies`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from .head_group import HeadGroup
from .masking import parametrizations
from .tied_heads import TiedHeadGroup


def parameter_holders(model: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """Per parameter (by id): the (module name, parameter name) of every module holding it."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            holders.setdefault(id(parameter), []).append((module_name, name))
    return holders


def cut_modules(model: nn.Module, group) -> list[nn.Module]:
    """The modules whose parameters `group` cuts: its layers cut by rows or columns and
    the holders of its per-unit tables, vectors, norms and scales."""
    modules = [*getattr(group, "kept_out", ()), *getattr(group, "kept_in", ())]
    for attribute in ("tables", "scales"):
        modules += [owner for owner, *_ in getattr(group, attribute, ())]
    modules += [owner for owner, _ in getattr(group, "row_vectors", ())]
    modules += [norm for norm, _ in getattr(group, "cut_norms", ())]
    modules += list(getattr(group, "channel_affines", ()))
    modules += [norm for norm, _ in getattr(group, "rms_norms", ())]
    modules += list(getattr(group, "response_norms", ()))
    modules += [getattr(group, name, None) for name in ("experts", "router", "bn", "group_norm")]
    if hasattr(group, "module_name"):  # an experts module's expert
        modules.append(model.get_submodule(group.module_name))
    return list({id(m): m for m in modules if isinstance(m, nn.Module)}.values())


def tie_sets(model: nn.Module, groups: list, ran: set[nn.Module]) -> list[list]:
    """The sets of two or more of `groups` that cut one tensor in different modules the
    example forward runs (a block several layers hold: its MLP in each), in model order:
    one mask must serve each set. (Two groups cutting one module, one its rows and one
    its columns, are no set.)"""
    shared = {key for key, places in parameter_holders(model).items() if len(places) > 1}
    cutting: dict[int, list[tuple[int, set[int]]]] = {}  # tensor: (group, its holders)
    for index, group in enumerate(groups):
        held: dict[int, set[int]] = {}
        for module in cut_modules(model, group):
            if module in ran:
                for p in module.parameters(recurse=False):
                    if id(p) in shared:
                        held.setdefault(id(p), set()).add(id(module))
        for key, modules in held.items():
            cutting.setdefault(key, []).append((index, modules))
    leader = list(range(len(groups)))

    def find(i: int) -> int:
        while leader[i] != i:
            leader[i] = leader[leader[i]]
            i = leader[i]
        return i

    for cuts in cutting.values():
        for i, (a, modules_a) in enumerate(cuts):
            for b, modules_b in cuts[:i]:
                if modules_a != modules_b:
                    leader[find(a)] = find(b)
    sets: dict[int, list] = {}
    for index, group in enumerate(groups):
        sets.setdefault(find(index), []).append(group)
    return [members for members in sets.values() if len(members) > 1]


def cut_alike(groups: list) -> bool:
    """Whether one mask can serve `groups`, a tie set: groups of one kind and size, under
    which every holder of a tensor they cut is cut alike (its rows where another
    holder's rows are cut, its columns where another's columns are)."""
    if len({type(g) for g in groups}) > 1 or len({g.size for g in groups}) > 1:
        return False
    cuts: dict[int, dict[int, set[str]]] = {}  # tensor: holder: how the set cuts it
    for group in groups:
        for role, layers in (("rows", "kept_out"), ("columns", "kept_in")):
            for layer in getattr(group, layers, ()):
                for p in layer.parameters(recurse=False):
                    cuts.setdefault(id(p), {}).setdefault(id(layer), set()).add(role)
    return all(len({frozenset(r) for r in held.values()}) == 1 for held in cuts.values())


def held_elsewhere(
    model: nn.Module, groups: list, ran: set[nn.Module], tied: list[list]
) -> dict[str, list[str]]:
    """Per group that would untie a weight: the names of its layers holding a parameter
    that a module neither it nor the groups `tied` with it cut holds too, where that
    module runs (one that never runs is handed the cut tensor at export)."""
    holders = parameter_holders(model)
    modules = dict(model.named_modules())
    names = {module: name for name, module in modules.items()}
    members = {id(g): s for s in tied for g in s}
    untied: dict[str, list[str]] = {}
    for group in groups:
        cut = cut_modules(model, group)
        together = [m for g in members.get(id(group), [group]) for m in cut_modules(model, g)]
        inside = {names[m] for m in together}
        layers = [
            names[m]
            for m in cut
            if any(
                any(h not in inside and modules[h] in ran for h, _ in holders[id(p)])
                for p in m.parameters(recurse=False)
            )
        ]
        if layers:
            untied[group.name] = layers
    return untied


def _own_weights(module: nn.Module) -> list[torch.Tensor]:
    """The parameters `module` holds itself, a parametrized one's original among them."""
    own: list[torch.Tensor] = list(module.parameters(recurse=False))
    lists = parametrizations(module).values()  # `original`, or original0, original1, ...
    own += [p for plist in lists for p in plist.parameters(recurse=False)]
    return own


def weight_copies(model: nn.Module) -> dict[nn.Module, nn.Module | None]:
    """The modules of `model` holding only weights a module before them holds (a shared
    block's later holders, Zamba2's), each with that first holder, and their
    parametrizations' lists (with None): the cost model counts those weights once, with
    the first holder, cut as whichever holder the pruner cuts."""
    first: dict[int, nn.Module] = {}
    copies: dict[nn.Module, nn.Module | None] = {}
    for module in model.modules():
        if isinstance(module, parametrize.ParametrizationList):
            continue
        own = _own_weights(module)
        if own and all(id(p) in first for p in own):
            copies[module] = first[id(own[0])]
            copies.update(dict.fromkeys(parametrizations(module).values()))
        for p in own:
            first.setdefault(id(p), module)
    return copies


def _plain(group: HeadGroup) -> bool:
    """Whether the attention layer holds nothing per head besides its projections (the
    one form pruned tied by its weights)."""
    extras = (
        group.tables,
        group.row_vectors,
        group.rescaled,
        group.norms,
        group.convs,
        group.row_norms,
        group.head_mixers,
        group.per_head_layers,
    )
    return type(group) is HeadGroup and not any(extras) and not group.refusal


def _weights(group: HeadGroup) -> tuple[int, ...]:
    """The ids of the parameters of the layer's projections, in order."""
    layers = [*group.kept_out, *group.kept_in]
    return tuple(id(p) for layer in layers for p in layer.parameters(recurse=False))


def tie_weight_sharing_heads(groups: list) -> list:
    """`groups` with the attention layers whose projections hold the same parameters (a
    block shared by several layers) made one group each, named after the first; the
    rest as they were. Layers sharing some of their weights only, or holding per-head
    parameters besides them, stay apart (and are refused: held_elsewhere)."""
    alike: dict[tuple[int, ...], list[HeadGroup]] = {}
    for group in groups:
        if isinstance(group, HeadGroup) and _plain(group):
            alike.setdefault(_weights(group), []).append(group)
    tied = {id(chain[0]): chain for chain in alike.values() if len(chain) > 1}
    later = {id(g) for chain in tied.values() for g in chain[1:]}
    result = []
    for group in groups:
        if id(group) in tied:
            result.append(TiedHeadGroup.of(tied[id(group)], {}))
        elif id(group) not in later:
            result.append(group)
    return result


class UntiedExportError(ValueError):
    """The holders of a weight the model holds once were cut apart."""


def holders(model: nn.Module) -> list[tuple[torch.Tensor, list[tuple[str, str]]]]:
    """Each parameter that several modules of `model` hold, with the (module name,
    parameter name) of every holder."""
    tensors = {id(p): p for m in model.modules() for p in m.parameters(recurse=False)}
    return [
        (tensors[key], places)
        for key, places in parameter_holders(model).items()
        if len(places) > 1
    ]


def _sync_sizes(module: nn.Module, name: str) -> None:
    """A linear or conv layer handed a cut weight: its size attributes follow it."""
    if name != "weight":
        return
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, nn.modules.conv._ConvNd):
        weight = module.weight
        module.out_channels, module.in_channels = weight.shape[0], weight.shape[1] * module.groups


@torch.no_grad()
def tie_again(tied: list[tuple[torch.Tensor, list[tuple[str, str]]]], exported: nn.Module) -> None:
    """Give every holder in `exported` of each weight of `tied` (holders(copy) of the
    copy before it was cut) one tensor again: the one its holders were cut to, which
    every cut holder must hold alike (else UntiedExportError naming them); a holder left
    uncut (a module the forward never runs) is handed it too."""
    modules = dict(exported.named_modules())
    for original, places in tied:
        # holders the export replaced or removed (a conv made an identity) are gone
        held = [
            (m, n) for m, n in places if isinstance(getattr(modules.get(m), n, None), nn.Parameter)
        ]
        tensors = [getattr(modules[m], n) for m, n in held]
        cut = [t for t in tensors if t is not original]
        if not cut or all(t is cut[0] for t in tensors):
            continue
        first = cut[0]
        if not all(t.shape == first.shape and torch.equal(t, first) for t in cut):
            shapes = {f"{m}.{n}": tuple(t.shape) for (m, n), t in zip(held, tensors, strict=True)}
            raise UntiedExportError(
                f"the modules holding one weight of the model were cut apart ({shapes}); "
                "the model is unchanged. Leave them whole with ignored_layers=[...]"
            )
        for (module_name, name), tensor in zip(held, tensors, strict=True):
            if tensor is not first:
                setattr(modules[module_name], name, first)
                _sync_sizes(modules[module_name], name)
