"""A pruned model saved as its builder plus safetensors weights, loaded without pickle.

The file is a safetensors file. Its header names the builder, an entry point
"package.module:function" (or "package.module:Class", or "...:Class.method") and the
keyword arguments that build the dense model, as JSON; the modules export replaced by one
of its own classes (an ``nn.MultiheadAttention`` that lost heads), by name and class; the
integer and float attributes that export changed (channel counts, ``num_heads``, a
GroupNorm's ``num_groups``, a Mamba-2 norm's epsilon, ...), per module; and the caller's
metadata. Loading imports and calls the builder, puts in the replacements, checks that
every saved tensor belongs to the model and is no larger than the dense one, gives each
module its saved attributes and shapes, and only then reads the weights.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

VERSION = "4"  # pruned-model format version of a builder + safetensors file
READS = ("3", VERSION)  # version 3 had no replaced modules
# what export changes: counts and shapes, and a Mamba-2 norm's rescaled epsilon
ATTRIBUTE_TYPES = (int, float, tuple)


def build(builder: object, kwargs: dict, field: str = "builder") -> nn.Module:
    """Import the entry point `builder` and call it with `kwargs`; errors name `field`."""
    if not isinstance(builder, str) or builder.count(":") != 1:
        raise ValueError(
            f"{field} = {builder!r}; it must be an entry point 'package.module:function' "
            "(or 'package.module:Class' or 'package.module:Class.method') that returns the "
            "nn.Module"
        )
    if not isinstance(kwargs, dict):
        raise TypeError(f"the keyword arguments of {field} must be a dict, got {type(kwargs)}")
    module_name, attribute = builder.split(":")
    target: Any  # the module, then each attribute the entry point names
    try:
        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{field} = {builder!r} cannot be imported: {error}") from error
    model = target(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{field} = {builder!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _attributes(model: nn.Module) -> dict[str, dict]:
    return {
        name: {
            key: value
            for key, value in vars(module).items()
            if not key.startswith("_")
            and isinstance(value, ATTRIBUTE_TYPES)
            and not isinstance(value, bool)
            and all(isinstance(v, int) for v in (value if isinstance(value, tuple) else ()))
        }
        for name, module in model.named_modules()
    }


def export_classes() -> dict[str, Any]:
    """The classes export puts in place of a model's modules (of the libraries imported:
    a model or builder holding their layers has imported them), by qualified name; each
    has `replaces` (the class it stands for) and `from_dense(module)` (one of the dense
    module's sizes)."""
    from .multihead_attention import PrunedMultiheadAttention
    from .pruned_classes import pruned_classes

    classes: list[Any] = [PrunedMultiheadAttention, *pruned_classes().values()]
    named = {f"{c.__module__}:{c.__qualname__}": c for c in classes}
    return named | {old: named[new] for old, new in FORMER_NAMES.items()}


# the names files written by earlier versions give classes that have moved since
FORMER_NAMES = {
    "dtp_kernels.pruning.heads:PrunedMultiheadAttention": (
        "dtp_kernels.pruning.multihead_attention:PrunedMultiheadAttention"
    ),
}


def _own_class(module: nn.Module) -> type:
    """The module's class; for a parametrized one (weight norm), the class it had before:
    each parametrized module gets a class of its own (ParametrizedConv1d)."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def replaced_modules(dense: nn.Module, pruned: nn.Module, path) -> dict[str, str]:
    """Per module name, the export class `pruned` has where `dense` has the class it
    replaces; ValueError naming a module of another class than the builder's."""
    classes = {c: name for name, c in export_classes().items() if name not in FORMER_NAMES}
    built = dict(dense.named_modules())
    replaced = {}
    for name, module in pruned.named_modules():
        if name not in built or _own_class(module) is _own_class(built[name]):
            continue
        if type(module) in classes and type(built[name]) is type(module).replaces:
            replaced[name] = classes[type(module)]
            continue
        raise ValueError(
            f"{path}: module {name!r} is a {type(module).__name__} where the builder's model "
            f"has a {type(built[name]).__name__}; a model loaded from the builder would not "
            "compute what it computes: save it without a builder (the pickled module, "
            "loaded with trusted=True)"
        )
    return replaced


def _put_replacements(model: nn.Module, replaced: dict[str, str], path) -> None:
    """Give `model` (the builder's) the export classes `replaced` names."""
    classes = export_classes()
    for name, class_name in replaced.items():
        cls = classes.get(class_name)
        if cls is None:
            raise ValueError(
                f"{path}: module {name!r} was replaced by {class_name!r}, which is not a "
                f"class export makes ({sorted(classes)})"
            )
        try:
            dense = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{path}: module {name!r} is not in the builder's model") from None
        if type(dense) is not cls.replaces:
            raise ValueError(
                f"{path}: module {name!r} of the builder's model is a {type(dense).__name__}, "
                f"not the {cls.replaces.__name__} the file's {cls.__name__} replaced"
            )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, cls.from_dense(dense))


def changed_attributes(dense: nn.Module, pruned: nn.Module, path) -> dict[str, dict]:
    """Per module name, the integer and float attributes `pruned` has that `dense` does
    not."""
    before, after = _attributes(dense), _attributes(pruned)
    if set(before) != set(after):
        extra = sorted(set(after) - set(before))[:3]
        raise ValueError(
            f"{path}: the builder's model does not have the modules of the model saved "
            f"(for example {extra}): builder or builder_kwargs do not build this model"
        )
    return {
        name: {key: list(value) if isinstance(value, tuple) else value for key, value in diff}
        for name in after
        if (diff := [(k, v) for k, v in after[name].items() if before[name].get(k) != v])
    }


def _check_unsaved_buffers(dense: nn.Module, pruned: nn.Module, path) -> None:
    """ValueError when export changed the shape of a buffer the file does not hold (not
    in the state dict: Falcon-H1's `mup_vector`): the loaded model would have the dense
    one, of the wrong size. A buffer that the class export gives the module's (or the
    module's own, once given) names in `remade_buffers` is made by its forward for its
    input (ConViT's relative positions), whether its heads were cut or not, and is left
    out."""
    from .pruned_classes import pruned_classes

    classes = pruned_classes()
    built = dict(dense.named_modules())
    changed = [
        f"{name}.{key}".lstrip(".")
        for name, module in pruned.named_modules()
        for key in module._non_persistent_buffers_set
        if key not in getattr(classes.get(type(module), type(module)), "remade_buffers", ())
        and name in built
        and isinstance(getattr(module, key, None), torch.Tensor)
        and isinstance(getattr(built[name], key, None), torch.Tensor)
        and getattr(module, key).shape != getattr(built[name], key).shape
    ]
    if changed:
        raise ValueError(
            f"{path}: the pruned model's buffers {changed[:3]} changed shape and are not "
            "saved in its state dict, so a model loaded from its builder would have the "
            "dense ones; save it without a builder (the pickled module, loaded with "
            "trusted=True)"
        )


def save_built(
    path: str | Path, model: nn.Module, builder: str, kwargs: dict, metadata: dict, header: dict
) -> None:
    """Write `model` with its builder to `path` (safetensors)."""
    from safetensors.torch import save_model

    dense = build(builder, kwargs)
    _check_unsaved_buffers(dense, model, path)
    replaced = replaced_modules(dense, model, path)
    fields = {
        **header,
        "version": VERSION,
        "builder": builder,
        "builder_kwargs": json.dumps(kwargs),
        "replaced": json.dumps(replaced),
        "attributes": json.dumps(changed_attributes(dense, model, path)),
        "metadata": json.dumps(metadata),
    }
    save_model(model, str(path), metadata=fields)


def is_safetensors(path: str | Path) -> bool:
    """Whether `path` starts with a safetensors header (8-byte length, then JSON)."""
    with open(path, "rb") as file:
        head = file.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def read_header(path: str | Path) -> tuple[dict, dict[str, tuple]]:
    """The header fields and the saved tensors' shapes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        fields = file.metadata() or {}
        names = list(file.keys())  # a safe_open handle is not iterable
        shapes = {key: tuple(file.get_slice(key).get_shape()) for key in names}
    return fields, shapes


def load_built(path: str | Path, fields: dict, shapes: dict[str, tuple]) -> nn.Module:
    """Build the dense model, shrink it to the saved attributes and shapes, read weights."""
    from safetensors.torch import load_model

    model = build(fields["builder"], json.loads(fields["builder_kwargs"]))
    _put_replacements(model, json.loads(fields.get("replaced", "{}")), path)
    own = model.state_dict()
    unknown = sorted(set(shapes) - set(own))
    if unknown:
        raise ValueError(
            f"{path} does not fit the model its builder makes (unexpected {unknown[:3]}): "
            "it was saved from another model"
        )
    grown = [
        key
        for key, shape in shapes.items()
        if len(shape) != own[key].dim()
        or any(s > o for s, o in zip(shape, own[key].shape, strict=True))
    ]
    if grown:
        raise ValueError(f"{path}: saved shapes do not fit the builder's model ({grown[:3]})")
    modules = dict(model.named_modules())
    for name, attributes in json.loads(fields["attributes"]).items():
        if name not in modules:
            raise ValueError(f"{path}: module {name!r} is not in the builder's model")
        for key, value in attributes.items():
            setattr(modules[name], key, tuple(value) if isinstance(value, list) else value)
    # one new tensor per tensor, for all its holders: tied weights stay tied (the file
    # names a tied weight once, as safetensors saves it)
    resized: dict[int, nn.Parameter] = {}
    for name, module in modules.items():
        prefix = f"{name}." if name else ""
        for key, tensor in module.named_parameters(recurse=False):
            shape = shapes.get(prefix + key)
            if shape is not None and shape != tuple(tensor.shape):
                resized.setdefault(id(tensor), nn.Parameter(tensor.new_empty(shape)))
        for key, tensor in list(module.named_buffers(recurse=False)):
            shape = shapes.get(prefix + key)
            if tensor is not None and shape is not None and shape != tuple(tensor.shape):
                module._buffers[key] = tensor.new_empty(shape)
    for module in modules.values():
        for key, tensor in list(module.named_parameters(recurse=False)):
            if id(tensor) in resized:
                setattr(module, key, resized[id(tensor)])
    with torch.no_grad():
        missing, unexpected = load_model(model, str(path), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}: the weights do not cover the builder's model (missing "
            f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    return model
