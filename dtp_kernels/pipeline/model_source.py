"""The model a recipe prunes: a built-in architecture, a torchvision one, the user's
own (any `package.module:function`) with the user's pretrained weights, or a Hugging
Face model saved with save_pretrained (`source: huggingface`, `path: DIR`: its weights
with it, read locally, never downloaded): a causal language model for text, an image
classifier for images.

    model:
      source: python                       # builtin (default) | torchvision | python
      entry: my_project.nets:build_net     # python: a callable returning an nn.Module
      kwargs: {width: 2}                   # passed to it (torchvision: to the builder)
      weights: checkpoints/dense.pt        # a state_dict, a dict holding one, or safetensors
      input_shape: [3, 32, 32]             # one example input, without the batch dim
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..models import get_model
from ..pruning.built_model import build, is_safetensors
from ..pruning.conv1d import conv1d_to_linear
from .errors import UsageError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SOURCES = ("builtin", "torchvision", "python", "huggingface")
RANDOM = "random"  # model.weights: start from the architecture's random initialisation
WEIGHT_KEYS = ("state_dict", "model")  # where a checkpoint file may hold the state_dict


def build_model(spec: Mapping, task: str = "classify") -> nn.Module:
    """The recipe's `model` section as a module with random weights (see load_weights),
    or, for source "huggingface", the pretrained model in `path` (task "causal_lm": a
    causal language model; else an image classifier)."""
    source = spec.get("source", "builtin")
    kwargs = dict(spec.get("kwargs") or {})
    if source not in SOURCES:
        raise UsageError(f"model.source = {source!r}; allowed: {list(SOURCES)}")
    if source == "huggingface":
        dtype = getattr(torch, spec.get("dtype", "float32"))
        return pretrained(spec.get("path"), kwargs, task, dtype)
    if source == "builtin":
        return get_model(spec["name"], spec["num_classes"], **kwargs)
    if source == "torchvision":
        import torchvision

        name = spec["name"].removeprefix("torchvision.")
        try:
            builder = torchvision.models.get_model_builder(name)
        except ValueError as error:
            raise UsageError(f"model.name = {name!r} is not a torchvision model") from error
        kwargs.setdefault("num_classes", spec["num_classes"])
        return builder(weights=None, **kwargs)
    return build(spec.get("entry"), kwargs, field="model.entry")


def pretrained(
    path: str | Path | None, kwargs: dict, task: str, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """transformers' AutoModelForCausalLM (task "causal_lm") or
    AutoModelForImageClassification from the local directory `path`, its parameters in
    `dtype` (model.dtype: float32 by default, the weights the stages train; run.amp gives
    bf16/fp16 compute). `kwargs` go to from_pretrained (attn_implementation; num_labels
    with ignore_mismatched_sizes for a new classifier head)."""
    config = Path(path or "") / "config.json"
    if path is None or not config.is_file():
        raise FileNotFoundError(
            f"model.path = {path!r}: no {config.name} there; give the directory a model "
            "was saved to with save_pretrained (config.json and the weights)"
        )
    import transformers

    auto, what = (
        (transformers.AutoModelForCausalLM, "a causal language model")
        if task == "causal_lm"
        else (transformers.AutoModelForImageClassification, "an image classifier")
    )
    try:
        model = auto.from_pretrained(path, local_files_only=True, dtype=dtype, **kwargs)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"model.path = {str(path)!r} does not load as {what}: {type(error).__name__}: {error}"
        ) from None
    # GPT-2's Conv1D layers as the nn.Linear layers the pruner takes (export puts them back)
    return conv1d_to_linear(model)


def hugging_face_model(model: nn.Module, what: str) -> PreTrainedModel:
    """`model` as the transformers model `what` needs; UsageError for another module."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise UsageError(
            f"{what} needs a Hugging Face model (model.source: huggingface), not a "
            f"{type(model).__name__}"
        )
    return model


def checkpoint_activations(model: nn.Module) -> None:
    """run.activation_checkpointing: transformers' non-reentrant activation checkpointing
    on a Hugging Face model (DTP's masks need it non-reentrant; docs/pruning.md)."""
    model = hugging_face_model(model, "run.activation_checkpointing = true")
    if not model.supports_gradient_checkpointing:
        raise UsageError(
            f"run.activation_checkpointing = true, but {type(model).__name__} (model.path) "
            "does not support transformers' gradient checkpointing; set it to false"
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def check_labels(model: nn.Module, num_classes: int) -> None:
    """A Hugging Face image classifier's labels match model.num_classes (the data's)."""
    model = hugging_face_model(model, "a classifier from model.path")
    labels = model.config.num_labels
    if labels != num_classes:
        raise UsageError(
            f"the classifier in model.path has {labels} labels and model.num_classes is "
            f"{num_classes}: set model.num_classes to the data's classes, and for a new "
            f"classifier head give model.kwargs {{num_labels: {num_classes}, "
            "ignore_mismatched_sizes: true}"
        )


def vocabulary_size(model: nn.Module) -> int:
    """The number of token ids a language model's input embedding takes."""
    model = hugging_face_model(model, "a causal language model (task causal_lm)")
    return cast(nn.Embedding, model.get_input_embeddings()).num_embeddings


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state_dict from `path`: a safetensors file (as the Hugging Face Hub and timm
    ship weights), or a torch file (torch.load with weights_only=True) holding the dict
    itself or the one under "state_dict" or "model"; DataParallel's "module." prefix is
    removed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model.weights = {str(path)!r}: no such file")
    payload: Any  # a dict of tensors, or what a torch file holds (checked below)
    try:
        if is_safetensors(path):
            from safetensors.torch import load_file

            payload = load_file(path, device="cpu")
        else:
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(
            f"model.weights = {str(path)!r} is not a readable weights file: {error}"
        ) from error
    if isinstance(payload, Mapping):
        for key in WEIGHT_KEYS:
            if isinstance(payload.get(key), Mapping):
                payload = payload[key]
                break
    if not isinstance(payload, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in payload.values()
    ):
        raise UsageError(
            f"model.weights = {str(path)!r} holds no state_dict (a dict of tensors, at the "
            f"top level or under {list(WEIGHT_KEYS)})"
        )
    if payload and all(k.startswith("module.") for k in payload):
        payload = {k.removeprefix("module."): v for k, v in payload.items()}
    return dict(payload)


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load the weights file into `model`; missing, unexpected or mis-shaped keys are an
    error that lists them (nothing is loaded then)."""
    state = read_state_dict(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: file {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        parts = [
            f"missing keys {missing}" if missing else "",
            f"unexpected keys {unexpected}" if unexpected else "",
            f"shape mismatches {shapes}" if shapes else "",
        ]
        raise UsageError(
            f"model.weights = {str(path)!r} does not fit the model: "
            + "; ".join(p for p in parts if p)
        )
    model.load_state_dict(state)


def example_input(spec: Mapping, dataset_sample: torch.Tensor | None) -> torch.Tensor:
    """One example input (batch 1) for tracing: model.input_shape, else a data sample."""
    shape = spec.get("input_shape")
    if shape is not None:
        dims = shape if isinstance(shape, list) else []
        if not dims or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims
        ):
            raise UsageError(
                f"model.input_shape = {shape!r}; a list of positive ints, "
                "without the batch dimension, e.g. [3, 224, 224]"
            )
        return torch.randn(1, *shape)
    if dataset_sample is None:
        raise UsageError("model.input_shape is needed: no data sample to trace the model with")
    return dataset_sample[:1]
