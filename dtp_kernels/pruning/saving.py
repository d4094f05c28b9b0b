"""Saving and loading an exported (physically pruned) model.

Three formats, all tagged and versioned:

- builder + safetensors (version 4; 3 is read too), for any model a function builds: the
  entry point "package.module:function" and its keyword arguments, the modules export
  replaced by its own classes, the attributes export changed and the weights as
  safetensors (built_model.py). Loading never unpickles anything.
- weights only (version 2), when the model is one `dtp_kernels.models.get_model` builds:
  the architecture's name, the pruning metadata and the state dict. Loading uses
  ``torch.load(weights_only=True)``: it builds the dense architecture, shrinks every conv,
  BN and linear layer to the saved shapes, checks every key and shape, and only then
  loads the weights, so a file from another architecture or ratio is refused before
  anything is loaded.
- pickled module (version 1), for any other model: the whole module is pickled, so
  loading needs ``weights_only=False`` and is allowed only with ``trusted=True``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch import nn

from . import built_model

FORMAT = "dtp-kernels/pruned-model"
VERSION = 2  # the newest format this module writes and reads
PICKLED = 1  # the version of the pickled-module format


def save_pruned(
    path: str | Path,
    model: nn.Module,
    architecture: dict | None = None,
    metadata: dict | None = None,
    *,
    builder: str | None = None,
    builder_kwargs: dict | None = None,
) -> None:
    """Write `model` (e.g. ``pruner.export()``) to `path`.

    builder: an entry point "package.module:function" that, called with `builder_kwargs`
        (JSON values), builds the dense model; the file is then safetensors with the
        builder in its header, loaded without pickle.
    architecture: ``{"name": ..., "num_classes": ...}`` as for ``get_model``; with it the
        file is weights only (torch format). metadata: plain values (e.g. method, ratios)
        stored with it in every format and checked by ``load_pruned(expect=...)``; a
        value of another type is a TypeError naming it, before anything is written.
    Neither: the module is pickled (loading needs ``trusted=True``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    # checked before writing: a value the file cannot hold plainly would leave a file
    # that loads only unpickled (torch format) or not at all (safetensors header)
    for name, given in (("metadata", metadata), ("builder_kwargs", builder_kwargs)):
        if given is not None and not isinstance(given, dict):
            raise TypeError(f"{name} must be a dict, got {type(given).__name__}")
    _check_plain(metadata or {}, "metadata")
    _check_plain(builder_kwargs or {}, "builder_kwargs")
    if builder is not None:
        if architecture is not None:
            raise ValueError("give builder or architecture, not both")
        header = {"format": FORMAT}
        kwargs = dict(builder_kwargs or {})
        built_model.save_built(path, model, builder, kwargs, dict(metadata or {}), header)
        return
    if builder_kwargs is not None:
        raise ValueError("builder_kwargs needs builder")
    if architecture is None:
        payload = {"format": FORMAT, "version": PICKLED, "model": model}
        torch.save({**payload, "metadata": dict(metadata or {})}, path)
        return
    if set(architecture) != {"name", "num_classes"}:
        raise ValueError(f"architecture needs exactly name and num_classes, got {architecture}")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(
        {
            "format": FORMAT,
            "version": VERSION,
            "architecture": dict(architecture),
            "metadata": dict(metadata or {}),
            "state_dict": state,
        },
        path,
    )


def _blocked_by_weights_only(error: pickle.UnpicklingError) -> bool:
    """Whether torch.load refused a global (a class or function the file asks for), as
    opposed to a file that is not a pickle at all."""
    return "unsupported global" in str(error).lower()


def load_pruned(
    path: str | Path,
    map_location: str | torch.device | None = None,
    expect: dict | None = None,
    trusted: bool = False,
) -> nn.Module:
    """Read a model written by :func:`save_pruned`.

    expect: architecture or metadata values the file must have, e.g.
        ``{"name": "resnet56", "ratios": "0.5"}``; a mismatch raises ValueError.
    trusted: allow the pickled-module format (it runs pickle: load only files you trust).
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"load_pruned: {path} does not exist")
    if built_model.is_safetensors(path):
        fields, shapes = built_model.read_header(path)
        if fields.get("format") != FORMAT or fields.get("version") not in built_model.READS:
            raise ValueError(
                f"{path} is a safetensors file but not a pruned model saved by "
                f"dtp_kernels.save_pruned with a builder (format {fields.get('format')!r}, "
                f"version {fields.get('version')!r})"
            )
        known = {**json.loads(fields["metadata"]), "builder": fields["builder"]}
        _check_expected(path, known, expect)
        model = built_model.load_built(path, fields, shapes)
        return model.to(map_location) if map_location is not None else model
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not _blocked_by_weights_only(error):
            raise ValueError(f"{path} is truncated or not a torch file ({error})") from error
        if not trusted:
            raise ValueError(
                f"{path} holds objects that weights_only=True does not load (a class or "
                "function: a pickled module); if it is a pickled-module file from save_pruned "
                "(a model get_model does not build) and you trust it, pass trusted=True"
            ) from error
        payload = torch.load(path, map_location=map_location, weights_only=False)
    except (RuntimeError, EOFError, ValueError, OSError) as error:
        raise ValueError(f"{path} is truncated or not a torch file ({error})") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pruned model saved by dtp_kernels.save_pruned")
    version = payload.get("version")
    if version == PICKLED:
        if not trusted:
            raise ValueError(f"{path} holds a pickled module; pass trusted=True to load it")
        _check_expected(path, payload.get("metadata", {}), expect)  # an older file holds none
        return payload["model"]
    if version != VERSION:
        raise ValueError(
            f"{path} has pruned-model format version {version!r}; this dtp_kernels reads "
            f"versions {PICKLED} and {VERSION}: upgrade dtp_kernels"
        )
    _check_expected(path, {**payload["metadata"], **payload["architecture"]}, expect)
    from ..models import get_model

    arch = payload["architecture"]
    model = get_model(arch["name"], arch["num_classes"])
    state = payload["state_dict"]
    _shrink_to(model, state, path)
    model.load_state_dict(state)
    return model.to(map_location) if map_location is not None else model


def _check_plain(value, where: str) -> None:
    """TypeError naming the entry of `value` (at `where`) that is not a plain value: None,
    a bool, int, float or str, or a list or dict (with str keys) of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has the key {key!r}; its keys must be strings")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; save_pruned stores plain values: None, "
        "numbers, strings, booleans, and lists and dicts of them"
    )


def _check_expected(path, known: dict, expect: dict | None) -> None:
    for key, value in (expect or {}).items():
        if known.get(key) != value:
            raise ValueError(
                f"{path} holds a model with {key} = {known.get(key)!r}, expected {value!r}"
            )


def _shrink_to(model: nn.Module, state: dict, path) -> None:
    """Give every conv, BN and linear layer of the dense `model` the saved shapes, after
    checking that the saved keys are the model's and no layer would grow."""
    own = model.state_dict()
    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state))[:3], sorted(set(state) - set(own))[:3]
        raise ValueError(
            f"{path} does not fit this architecture (missing {missing}, unexpected {extra}): "
            "it was saved from another model"
        )
    bad = [
        k
        for k in own
        if state[k].dim() != own[k].dim()
        or any(s > o for s, o in zip(state[k].shape, own[k].shape, strict=True))
    ]
    if bad:
        raise ValueError(f"{path}: saved shapes do not fit this architecture ({bad[:3]})")
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        weight = state.get(prefix + "weight")
        if isinstance(module, nn.Conv2d) and weight is not None:
            depthwise = module.groups > 1 and module.groups == module.in_channels
            module.out_channels = weight.shape[0]
            module.groups = weight.shape[0] if depthwise else module.groups
            module.in_channels = weight.shape[1] * module.groups
        elif isinstance(module, nn.BatchNorm2d):
            module.num_features = state[prefix + "running_mean"].shape[0]
        elif isinstance(module, nn.Linear) and weight is not None:
            module.out_features, module.in_features = weight.shape
        for key, tensor in list(module.named_parameters(recurse=False)):
            setattr(module, key, nn.Parameter(tensor.new_empty(state[prefix + key].shape)))
        for key, tensor in list(module.named_buffers(recurse=False)):
            if prefix + key in state:
                module._buffers[key] = tensor.new_empty(state[prefix + key].shape)
