"""Recipes: YAML files in dtp_kernels/configs/ with the paper's training settings; any field can be
overridden as `section.key=value` (the value is read as YAML). `load` checks the whole
recipe against schema.FIELDS before returning it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import yaml

from . import schema
from .errors import RecipeError

DEFAULTS = {
    "seed": 0,
    # augment: the paper's training augmentation (CIFAR: random crop 32 with padding 4 and
    # flip; ImageFolder: RandomResizedCrop and flip). num_workers null: data.default_workers.
    # pin_memory null: on when the run's device is CUDA. text (causal language models):
    # root holds train.txt and val.txt, cut into blocks of seq_len tokens; tokenizer:
    # model (the one in model.path) | bytes (token id = byte value) | pretokenized (root
    # holds train.npy and val.npy, token ids, memory-mapped). accumulate: batches
    # whose gradients make one optimizer step (a step's batch: batch_size x accumulate x
    # the number of processes).
    "data": {
        "name": "digits",
        "root": None,
        "batch_size": 64,
        "eval_batch_size": 512,
        "accumulate": 1,
        "augment": True,
        "image_size": 224,
        "num_workers": None,
        "pin_memory": None,
        "persistent_workers": True,
        "prefetch_factor": None,
        # skip_bad_files: an unreadable image file is counted and left out instead of
        # stopping the run (ImageFolder); the summary gives the count.
        "skip_bad_files": False,
        "seq_len": 128,
        "tokenizer": "model",
    },
    # source: builtin | torchvision | python (entry "package.module:function" + kwargs);
    # weights: the dense model's state_dict file, or "random" to prune a random network.
    # huggingface: a causal language model saved with save_pretrained in the directory
    # path (its weights with it; read locally, never downloaded).
    "model": {
        "name": "digits_cnn",
        "num_classes": 10,
        "source": "builtin",
        "entry": None,
        "kwargs": {},
        "weights": None,
        "input_shape": None,
        "path": None,
        # dtype: the parameters' type, float32 | bfloat16 (huggingface only: half the
        # memory of weights and gradients; compensated updates).
        "dtype": "float32",
        # optimizer_state_dtype: the moments' and momentum buffers' type, float32 |
        # bfloat16 (with dtype bfloat16: 2 bytes a weight less per moment, but a
        # bfloat16 second moment cannot follow its gradients).
        "optimizer_state_dtype": "float32",
    },
    # optimizer (every stage): sgd (momentum, weight_decay) | adamw (weight_decay; the
    # default betas). warmup_steps: a linear learning-rate warm-up over that many
    # optimizer steps; max_grad_norm: the model's gradients clipped to that total norm;
    # max_steps: the stage ends after its epochs or that many optimizer steps, whichever
    # come first (the schedule spans the steps run; a large corpus need not be a whole
    # epoch).
    "pretrain": {
        "epochs": 0,
        "optimizer": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "warmup_steps": 0,
        "max_grad_norm": None,
        "max_steps": None,
    },
    # skip: module names (globs) never pruned; penalty_weight: of the FLOPs penalty.
    # granularity: filter | weight | n:m (nm: [N, M], N of every M weights kept).
    # scores: learned (a parameter of the pruner) | magnitude (|w|, weight and n:m only).
    "prune": {
        "method": "dtp",
        "ratios": 0.5,
        "budget": "layer",
        "granularity": "filter",
        "nm": [2, 4],
        "scores": "learned",
        "eps": 1.0,
        "iters": 1,
        "skip": [],
        "epochs": 10,
        "optimizer": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "schedule": "cosine",
        "flops_target": None,
        "penalty_weight": 10.0,
        "warmup_steps": 0,
        "max_grad_norm": None,
        "max_steps": None,
        # train_weights false: the DTP stage learns the masks alone, the model's weights
        # frozen (no gradients or optimizer state for them); fine-tuning trains them.
        "train_weights": True,
    },
    "finetune": {
        "epochs": 10,
        "optimizer": "sgd",
        "lr": 0.01,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "schedule": "step",
        "milestones": [],
        "gamma": 0.1,
        "warmup_steps": 0,
        "max_grad_norm": None,
        "max_steps": None,
    },
    # device: auto (CUDA when available) | cpu | cuda | cuda:N; under torchrun each rank
    # takes cuda:LOCAL_RANK. amp: null, "bf16" or "fp16" (torch.autocast; fp16 with a
    # GradScaler). compile: torch.compile the training step (default mode).
    # checkpoint_minutes / checkpoint_steps: a mid-epoch checkpoint at least this often
    # (either may be null; both null: only at the end of every epoch and at a signal).
    # activation_checkpointing: a huggingface model's layers recomputed in the backward
    # (transformers' activation_checkpointing_enable, non-reentrant): less memory, more time.
    # eval_every_steps: also evaluate (a metrics line with "step") every that many
    # optimizer steps within an epoch; null: at the end of every epoch only.
    # sharding: null (under torchrun each rank holds the whole model, DDP) or "fsdp"
    # (FSDP2 shards the weights, gradients and optimizer state of every stage over the
    # ranks); shard_units: globs naming the modules sharded one by one
    # (default: a Hugging Face model's blocks).
    "run": {
        "device": "auto",
        "amp": None,
        "channels_last": False,
        "compile": False,
        "progress": True,
        "tensorboard": True,
        "plots": True,
        "checkpoint_minutes": 10.0,
        "checkpoint_steps": None,
        "eval_every_steps": None,
        "activation_checkpointing": False,
        "sharding": None,
        "shard_units": [],
    },
}
# dict fields whose keys are the user's, replaced whole (a ratio map set by --set
# replaces the recipe's, never merges into it)
FREE_FORM = ("model.kwargs", "prune.ratios")


def merge(base: dict, update: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    if not isinstance(update, dict):
        raise RecipeError(f"the recipe must be a mapping of sections, got {update!r}")
    for key, value in update.items():
        if key not in out:
            raise RecipeError(f"unknown recipe field '{where}{key}'; known: {sorted(out)}")
        nested = isinstance(out[key], dict) and f"{where}{key}" not in FREE_FORM
        if nested and isinstance(value, dict):
            out[key] = merge(out[key], value, f"{where}{key}.")
        elif nested:
            raise RecipeError(
                f"recipe field '{where}{key}' is a section, got {value!r}; set its fields "
                f"as {where}{key}.KEY=VALUE (known: {sorted(out[key])})"
            )
        else:
            out[key] = value
    return out


def _parse(assignment: str) -> dict:
    """{"a": {"b": value}} of one `a.b=value` override."""
    if not isinstance(assignment, str) or "=" not in assignment:
        raise RecipeError(f"override {assignment!r} is not of the form section.key=value")
    path, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise RecipeError(f"override {assignment!r}: the value is not YAML ({error})") from None
    update: dict = {}
    node = update
    keys = path.strip().split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return update


def override(recipe: dict, assignment: str) -> dict:
    """Apply one `a.b=value` override."""
    return merge(recipe, _parse(assignment))


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> dict:
    """The defaults, updated by the file at `path` and then by each override, checked
    whole: a RecipeError names the first bad field, its value and where it was set."""
    recipe = copy.deepcopy(DEFAULTS)
    sources: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"--config {path}: no such recipe file")
        try:
            content = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise RecipeError(f"recipe {path} is not valid YAML: {error}") from None
        recipe = merge(recipe, content)
        sources.update(dict.fromkeys(schema.flatten(content), f"recipe {path}"))
    for assignment in overrides:
        update = _parse(assignment)
        recipe = merge(recipe, update)
        sources.update(dict.fromkeys(schema.flatten(update), f"--set {assignment}"))
    schema.validate(recipe, sources)
    return recipe
