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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .cuts import cut_linear
from .groups import ChannelGroup
from .proof import cuts_exactly, dropped, example_calls


class FormMLPGroup(ChannelGroup):
    """The hidden neurons of an MLP module found by its form (not by Torch-Pruning's
    graph): the producers in `kept_out`, the consumer in `kept_in`, the mask on the
    consumer's input columns (`gated`). Export cuts the rows and columns directly."""


# an MLP module's form: the names of its producers and of its consumer
Form = tuple[tuple[str, ...], str]


def _forms(module: nn.Module) -> list[Form]:
    """The ways `module` can be the form above: every parameter in two or three of its
    direct linear children, one of them (the consumer) reading the others' output width.
    Empty for any other module. (Shapes alone may fit twice: 8 -> 10 -> 8 read either
    way; the proof tells them apart.)"""
    linears = {name: m for name, m in module.named_children() if isinstance(m, nn.Linear)}
    if len(linears) not in (2, 3):
        return []
    owned = {id(p) for m in linears.values() for p in m.parameters()}
    if any(id(p) not in owned for p in module.parameters()):
        return []  # a norm, an embedding or a parameter of its own is in it too
    forms = []
    for consumer in reversed(linears):  # the down projection is most often registered last
        producers = tuple(name for name in linears if name != consumer)
        width, first = linears[consumer].in_features, linears[producers[0]]
        if width > 1 and all(
            linears[p].in_features == first.in_features and linears[p].out_features == width
            for p in producers
        ):
            forms.append((producers, consumer))
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


def find_form_mlps(model: nn.Module, ignored: list[nn.Module], inputs: tuple) -> list[FormMLPGroup]:
    """The MLP modules of `model` in the form above that run on `inputs` and cut exactly,
    none of whose layers is in `ignored`, in model order."""
    names = {module: name for name, module in model.named_modules()}
    ignored_set = set(ignored)
    candidates = {
        module: forms
        for module in model.modules()
        if (forms := _forms(module))
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
        producer_names, consumer_name = proven
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
            )
        )
    return groups


def _proven(module: nn.Module, form: Form, call: tuple[tuple, dict]) -> bool:
    """Whether `module`, read as `form`, cuts exactly on its example call (proof.py)."""
    producers, consumer = form

    def zero(copy: nn.Module, keep: torch.Tensor) -> None:
        weight = getattr(copy, consumer).weight
        weight[:, dropped(weight.shape[1], keep, weight.device)] = 0

    def cut(copy: nn.Module, keep: torch.Tensor) -> None:
        layers = [getattr(copy, p) for p in producers]
        cut_hidden(copy, layers, getattr(copy, consumer), keep)

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
    producers = [names[original_names[m]] for m in group.kept_out]
    consumer = names[original_names[group.kept_in[0]]]
    parent = names[group.name.rpartition(".")[0]]
    cut_hidden(parent, producers, consumer, keep)
