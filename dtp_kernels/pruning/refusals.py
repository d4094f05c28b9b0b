"""Every group that cannot be pruned exactly, with why, in one error.

The checks run on the groups the ratios prune, after their ratios are resolved and
before any mask exists. Each finds the groups whose export would not compute what the
hard-masked model does (a weight transformed in the forward, a normalization over all
channels, a tensor another running module holds, a reader outside the group, attention
heads or routers that fail their proof on the example); all of them go in one
ValueError, which ends with the ratios that leave those groups whole, so a user who
gives them prunes the rest at the next try.
"""

from __future__ import annotations

from torch import nn

from . import masking
from . import ratios as ratio_rules
from .enclosing_readers import enclosing_reader_refusals
from .group_kinds import kind_of
from .groups import ChannelGroup
from .heads import HeadGroup, prove_head_groups
from .shared_weights import cut_alike, cut_modules, held_elsewhere, tie_sets
from .weight_transforms import weight_transform_refusals
from .whole_experts import WholeExpertsGroup, prove_whole_expert_groups


def zero_ratios(ratios, names: list[str]) -> str:
    """The ratios that leave the groups `names` whole and prune the rest as `ratios` asks,
    for an error message (ratio_rules.with_zeros); any other form is named as is."""
    zeroed = ratio_rules.with_zeros(ratios, names)
    return f"ratios={zeroed}" if zeroed is not None else f"the keys {names} with 0"


# the head of a refusal whose export would not compute what the masked model does
INEXACT = "cannot prune these groups so that the exported model equals the masked one"


def parametrized_layers(model: nn.Module, groups: list) -> dict[str, dict[str, list[str]]]:
    """The layers that `groups` cut (or mask) whose tensors the model parametrizes itself
    (a weight norm: `weight` computed from `original0` and `original1`), by name, with
    those tensors' parametrizations: export cannot cut a computed tensor."""
    names = {m: n for n, m in model.named_modules()}
    found = {}
    for group in groups:
        touched = [*getattr(group, "kept_out", ()), *getattr(group, "kept_in", ())]
        touched.append(getattr(group, "layer", None))
        for module in touched:
            if isinstance(module, nn.Module) and (own := masking.foreign_parametrizations(module)):
                found[names[module]] = own
    return found


def refuse_inexact(
    model: nn.Module,
    groups: list,
    all_groups: list,
    per_group: dict[str, float],
    budget: str,
    ran: set[nn.Module],
    inputs: tuple,
    ratios,
) -> list[list]:
    """Raise one ValueError naming every group of `groups` (those with a ratio above 0
    in `per_group`) that cannot be pruned exactly, with why and the ratios (`ratios`, as
    the user gave them, with zeros) that leave them whole; `all_groups` are every group
    found (a tie set counts its groups left whole too), `ran` the modules the example
    forward `inputs` ran. Else return the tie sets: the groups that cut one tensor
    several modules hold, each of which prunes with one mask (shared_weights.py)."""
    refusals: list[tuple[str, list[str]]] = []  # (what and why, the groups' names)

    def open_groups(kind=None) -> list:
        refused = {name for _, names in refusals for name in names}
        return [g for g in groups if g.name not in refused and (kind is None or type(g) is kind)]

    # layers whose forward transforms their weight, proven on the example
    transformed = weight_transform_refusals(model, open_groups(ChannelGroup), inputs)
    if transformed:
        details = " / ".join(
            f"layer {name!r}: {'; '.join(lines)}" for name, lines in transformed.items()
        )
        refusals.append(
            (
                f"{INEXACT}: {details}. Such a layer transforms its weight in its forward "
                "(weight standardization normalizes each filter over all its input "
                "channels)",
                list(transformed),
            )
        )
    parametrized = {g.name: parametrized_layers(model, [g]) for g in open_groups()}
    parametrized = {name: own for name, own in parametrized.items() if own}
    if parametrized:
        layers = {layer: own for each in parametrized.values() for layer, own in each.items()}
        details = "; ".join(
            f"layer {layer!r}: {', '.join(f'{t} by {classes}' for t, classes in own.items())}"
            for layer, own in layers.items()
        )
        refusals.append(
            (
                f"cannot prune these groups: the model parametrizes tensors of layers they "
                f"cut ({details}), which export cannot cut; fold the parametrization into "
                "the tensor first (torch.nn.utils.parametrize.remove_parametrizations("
                "layer, name))",
                list(parametrized),
            )
        )
    normed = [g for g in open_groups() if g.norms]
    if normed:
        names = {m: n for n, m in model.named_modules()}
        feeds = {
            g.name: ", ".join(f"{type(m).__name__} {names[m]!r}" for m in g.norms) for g in normed
        }
        details = "; ".join(f"layer {name!r} feeds {norms}" for name, norms in feeds.items())
        refusals.append(
            (
                f"{INEXACT}: {details}. A normalization over all channels (LayerNorm, "
                "a second GroupNorm) computes every channel from all the others, so "
                "removing any changes the rest (an RMS norm is rescaled at export only "
                "where the removed channels reach it as zeros, through linear layers: "
                "docs/architectures.md, Normalizations)",
                [g.name for g in normed],
            )
        )
    # groups cutting one tensor that several modules hold (a block several layers
    # hold: shared_weights.py) prune with one mask, or are refused
    tied = tie_sets(model, all_groups, ran)
    apart = [
        s
        for s in tied
        if len({per_group[g.name] for g in s}) > 1 or budget != "layer" or not cut_alike(s)
    ]
    if apart:
        details = "; ".join(str([g.name for g in s]) for s in apart)
        refusals.append(
            (
                f"cannot prune these groups apart: each set cuts one tensor that its layers "
                f"hold, so they take one mask, with one ratio under budget='layer', where "
                f"they are of one kind and size and cut the tensor alike ({details})",
                [g.name for s in apart for g in s if per_group[g.name] > 0],
            )
        )
    tied = [s for s in tied if s not in apart]
    shared = held_elsewhere(model, open_groups(), ran, tied)
    names = {module: name for name, module in model.named_modules()}
    for g in open_groups():  # shared layers the channel graph cuts that cut_modules misses
        known = {names[m] for m in cut_modules(model, g)}
        missed = [n for n in getattr(g, "shared_weights", ()) if n not in known]
        if missed:
            shared[g.name] = list(dict.fromkeys([*shared.get(g.name, []), *missed]))
    if shared:
        details = "; ".join(
            f"layer {name!r} cuts {', '.join(map(repr, layers))}" for name, layers in shared.items()
        )
        refusals.append(
            (
                f"cannot prune these groups: they cut layers whose weights other modules "
                f"hold too and run ({details}: an output layer tied to the embedding), "
                "and export would untie them",
                list(shared),
            )
        )
    # the modules that read a group's channels from outside it, proven on the example
    enclosing = enclosing_reader_refusals(model, open_groups(ChannelGroup), inputs)
    if enclosing:
        details = " / ".join(
            f"layer {name!r} is read by {'; '.join(lines)}" for name, lines in enclosing.items()
        )
        refusals.append((f"{INEXACT}: {details}", list(enclosing)))
    # the heads to prune are proven on the example (a copy of each attention layer)
    heads = [g for g in open_groups() if isinstance(g, HeadGroup) and not g.refusal]
    prove_head_groups(model, heads, inputs)
    # and the routers of the blocks to lose experts, at the counts asked for
    whole = [g for g in open_groups() if isinstance(g, WholeExpertsGroup)]
    kept = {g.name: ratio_rules.kept_count(g.size, per_group[g.name]) for g in whole}
    prove_whole_expert_groups(model, whole, kept, inputs)
    unproven = [g for g in open_groups() if getattr(g, "refusal", "")]
    if unproven:
        what = {
            "heads": "the heads of attention layer",
            "linear_attention": "the heads of linear-attention layer",
            "whole_experts": "whole experts of",
        }
        details = "; ".join(f"{what[kind_of(g)]} {g.name!r}: {g.refusal}" for g in unproven)
        refusals.append((f"cannot prune {details}", [g.name for g in unproven]))
    if refusals:
        left_whole = list(dict.fromkeys(name for _, group in refusals for name in group))
        for members in tied:  # a set's groups are left whole together, or none
            if any(g.name in left_whole for g in members):
                left_whole += [g.name for g in members if g.name not in left_whole]
        raise ValueError(
            ". ".join(what for what, _ in refusals)
            + ". Leave these layers whole with ignored_layers=[...] or a ratio of 0 for "
            f"them: {zero_ratios(ratios, left_whole)}"
        )
    return tied
