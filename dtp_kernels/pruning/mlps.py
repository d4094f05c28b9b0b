"""MLP modules found by their form, where Torch-Pruning's graph cannot follow the model.

When the DependencyGraph fails on a model (DeepSeek-V3's build, DeepSeek-V2's latent
key/value projection), the hidden neurons of its MLPs can still be pruned: an MLP module
is recognised by its parameters alone, and proven on its own input (proof.py).

The form: every parameter of the module belongs to two or three of its own linear layers,
the producers (one, or a gate and an up projection of the same shape) widening the input
to a hidden width and the consumer (the down projection) reading that width back. The
proof: on the input the example forward gave it, the module with the consumer's columns
of half its neurons zeroed computes what the module with those neurons removed computes
(the producers' rows and the consumer's columns cut). The mask goes on the consumer's
columns, as for a gated MLP the graph finds: exact whatever the activation computes.

An RMS norm over the hidden width between them (BitNet's `ffn_sub_norm`: down(norm(act(
gate) * up))) is part of the form too. The consumer's columns would not keep it exact
(the removed neurons still count in its mean square), so the mask goes on the rows of
the producer the norm reads linearly (up, found by the proof: scaling gate's rows does
not scale act(gate)), and export cuts the norm and rescales it with those rows as
head_norms.py does for a norm over all heads; Torch-Pruning's graph gives up on such an
MLP, so it is found by its form even where the graph works.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .cuts import as_linear, cut_linear
from .groups import ChannelGroup
from .head_norms import cut_norm
from .proof import cuts_exactly, dropped, example_calls


@dataclass
class FormMLPGroup(ChannelGroup):
    """The hidden neurons of an MLP module found by its form (not by Torch-Pruning's
    graph): the producers in `kept_out`, the consumer in `kept_in`, the mask on the
    consumer's input columns (`gated`), or with an RMS norm over the hidden width
    (`norm`) on the rows of the producer it reads linearly (`norm_rows`). Export cuts
    the rows and columns directly, and the norm rescaled."""

    norm: nn.Module | None = None
    norm_rows: nn.Linear | None = None

    @property
    def cut_norms(self) -> list[tuple[nn.Module, int]]:
        return [(self.norm, 1)] if self.norm is not None else []


# an MLP module's form: the names of its producers and of its consumer, and of an RMS
# norm over the hidden width with the producer whose rows take the mask (else None)
Form = tuple[tuple[str, ...], str, str | None, str | None]


def _hidden_norm(module: nn.Module, linears: Mapping[str, nn.Module]) -> str | None:
    """The name of `module`'s one child outside `linears` that owns parameters, when
    that child's only parameter is a 1-D weight (an RMS norm's); else None (any other
    parameter then fails the form's ownership check)."""
    others = [
        (name, child)
        for name, child in module.named_children()
        if name not in linears and any(True for _ in child.parameters())
    ]
    if len(others) != 1:
        return None
    params = dict(others[0][1].named_parameters())
    return others[0][0] if set(params) == {"weight"} and params["weight"].dim() == 1 else None


def _forms(module: nn.Module) -> list[Form]:
    """The ways `module` can be the form above: every parameter in two or three of its
    direct linear children, one of them (the consumer) reading the others' output width,
    and maybe in one norm over that width. Empty for any other module. (Shapes alone may
    fit twice: 8 -> 10 -> 8 read either way; the proof tells them apart.)"""
    linears = {name: m for name, m in module.named_children() if isinstance(m, nn.Linear)}
    if len(linears) not in (2, 3):
        return []
    norm = _hidden_norm(module, linears)
    owners = [*linears.values(), *([getattr(module, norm)] if norm is not None else [])]
    owned = {id(p) for m in owners for p in m.parameters()}
    if any(id(p) not in owned for p in module.parameters()):
        return []  # an embedding, a parameter of its own, another module is in it too
    forms: list[Form] = []
    for consumer in reversed(linears):  # the down projection is most often registered last
        producers = tuple(name for name in linears if name != consumer)
        width, first = linears[consumer].in_features, linears[producers[0]]
        if width > 1 and all(
            linears[p].in_features == first.in_features and linears[p].out_features == width
            for p in producers
        ):
            if norm is None:
                forms.append((producers, consumer, None, None))
            elif getattr(module, norm).weight.shape[0] == width:
                forms += [(producers, consumer, norm, rows) for rows in reversed(producers)]
    return forms


def cut_hidden(
    module: nn.Module, producers: Sequence[nn.Linear], consumer: nn.Linear, keep: torch.Tensor
) -> None:
    """Remove the hidden neurons not in `keep` (sorted indices) from an MLP module: its
    producers' rows, its consumer's columns, and the module's attributes that held the
    old width (DeepSeek's and Llama's `intermediate_size`)."""
    width = consumer.in_features
    for layer in producers:
        cut_linear(layer, keep, 0)
    cut_linear(consumer, keep, 1)
    for name in ("intermediate_size", "hidden_features", "ffn_dim"):
        if getattr(module, name, None) == width:
            setattr(module, name, len(keep))


def find_form_mlps(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple, normed_only: bool = False
) -> list[FormMLPGroup]:
    """The MLP modules of `model` in the form above that run on `inputs` and cut exactly,
    none of whose layers is in `ignored`, in model order; with `normed_only` only those
    with a norm over the hidden width (where the graph worked: it leaves them out)."""
    names = {module: name for name, module in model.named_modules()}
    ignored_set = set(ignored)
    candidates = {
        module: forms
        for module in model.modules()
        if (forms := [f for f in _forms(module) if f[2] is not None or not normed_only])
        and module not in ignored_set
        and not any(isinstance(m, nn.Linear) and m in ignored_set for m in module.children())
    }
    calls = example_calls(model, list(candidates), inputs)
    groups = []
    for module, forms in candidates.items():
        if module not in calls:  # never ran on the example: _warn_idle_layers names it
            continue
        proven = next((f for f in forms if _proven(module, f, calls[module])), None)
        if proven is None:
            continue
        producer_names, consumer_name, norm, rows = proven
        producers = [getattr(module, p) for p in producer_names]
        root = producers[0]
        groups.append(
            FormMLPGroup(
                names[root],
                root,
                None,
                root.out_features,
                producers,
                [getattr(module, consumer_name)],
                gated=True,
                norm=getattr(module, norm) if norm is not None else None,
                norm_rows=getattr(module, rows) if rows is not None else None,
            )
        )
    return groups


def _proven(module: nn.Module, form: Form, call: tuple[tuple, dict]) -> bool:
    """Whether `module`, read as `form`, cuts exactly on its example call (proof.py)."""
    producers, consumer, norm, rows = form

    def zero(copy: nn.Module, keep: torch.Tensor) -> None:
        if norm is None or rows is None:  # the consumer's columns (no norm: no rows)
            weight = getattr(copy, consumer).weight
            weight[:, dropped(weight.shape[1], keep, weight.device)] = 0
            return
        layer = getattr(copy, rows)  # the rows the norm reads, with their bias
        gone = dropped(layer.out_features, keep, layer.weight.device)
        for param in (layer.weight, layer.bias) if layer.bias is not None else (layer.weight,):
            param[gone] = 0

    def cut(copy: nn.Module, keep: torch.Tensor) -> None:
        layers = [getattr(copy, p) for p in producers]
        cut_hidden(copy, layers, getattr(copy, consumer), keep)
        if norm is not None and rows is not None:
            cut_norm(getattr(copy, norm), getattr(copy, rows), keep)

    return cuts_exactly(module, call, getattr(module, consumer).in_features, zero, cut)


def prune_form_mlp(
    group: FormMLPGroup,
    names: dict[str, nn.Module],
    original_names: dict[nn.Module, str],
    mask: torch.Tensor,
) -> None:
    """Cut the neurons whose hard mask is 0 from the exported copy's MLP module (`names`:
    the copy's modules by name; `original_names`: the pruned model's names)."""
    keep = mask.nonzero().flatten()
    if len(keep) == len(mask):
        return
    producers = [as_linear(names[original_names[m]]) for m in group.kept_out]
    consumer = as_linear(names[original_names[group.kept_in[0]]])
    parent = names[group.name.rpartition(".")[0]]
    cut_hidden(parent, producers, consumer, keep)
    if group.norm is not None:  # rescaled with the rows it reads (head_norms.py)
        assert group.norm_rows is not None  # found with the norm (_forms)
        norm = names[original_names[group.norm]]
        cut_norm(norm, as_linear(names[original_names[group.norm_rows]]), keep)
