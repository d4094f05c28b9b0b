"""Recipes: YAML files in dtp_kernels/configs/ with the paper's training settings; any field can be
overridden as `section.key=value` (the value is read as YAML)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

DEFAULTS = {
    "seed": 0,
    # augment: the paper's training augmentation (CIFAR: random crop 32 with padding 4 and
    # flip; ImageFolder: RandomResizedCrop and flip). num_workers null: data.default_workers.
    # pin_memory null: on when the run's device is CUDA.
    "data": {
        "name": "digits",
        "root": None,
        "batch_size": 64,
        "eval_batch_size": 512,
        "augment": True,
        "image_size": 224,
        "num_workers": None,
        "pin_memory": None,
        "persistent_workers": True,
        "prefetch_factor": None,
    },
    # source: builtin | torchvision | python (entry "package.module:function" + kwargs);
    # weights: the dense model's state_dict file, or "random" to prune a random network.
    "model": {
        "name": "digits_cnn",
        "num_classes": 10,
        "source": "builtin",
        "entry": None,
        "kwargs": {},
        "weights": None,
        "input_shape": None,
    },
    "pretrain": {"epochs": 0, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
    # skip: module names (globs) never pruned; penalty_weight: of the FLOPs penalty.
    "prune": {
        "method": "dtp",
        "ratios": 0.5,
        "budget": "layer",
        "granularity": "filter",
        "eps": 1.0,
        "iters": 1,
        "skip": [],
        "epochs": 10,
        "lr": 0.1,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "schedule": "cosine",
        "flops_target": None,
        "penalty_weight": 10.0,
    },
    "finetune": {
        "epochs": 10,
        "lr": 0.01,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "schedule": "step",
        "milestones": [],
        "gamma": 0.1,
    },
    # device: auto (CUDA when available) | cpu | cuda | cuda:N; under torchrun each rank
    # takes cuda:LOCAL_RANK. amp: null, "bf16" or "fp16" (torch.autocast; fp16 with a
    # GradScaler). compile: torch.compile the training step (default mode).
    "run": {
        "device": "auto",
        "amp": None,
        "channels_last": False,
        "compile": False,
        "progress": True,
        "tensorboard": True,
        "plots": True,
    },
}
FREE_FORM = ("model.kwargs",)  # dict fields whose keys are the user's, replaced whole


def merge(base: dict, update: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if key not in out:
            raise ValueError(f"unknown recipe field '{where}{key}'; known: {sorted(out)}")
        nested = isinstance(out[key], dict) and f"{where}{key}" not in FREE_FORM
        if nested and isinstance(value, dict):
            out[key] = merge(out[key], value, f"{where}{key}.")
        else:
            out[key] = value
    return out


def override(recipe: dict, assignment: str) -> dict:
    """Apply one `a.b=value` override."""
    if "=" not in assignment:
        raise ValueError(f"override {assignment!r} is not of the form section.key=value")
    path, raw = assignment.split("=", 1)
    update: dict = {}
    node = update
    keys = path.strip().split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = yaml.safe_load(raw)
    return merge(recipe, update)


def load(path: str | Path | None, overrides: list[str] = ()) -> dict:
    recipe = copy.deepcopy(DEFAULTS)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"recipe {path} does not exist")
        recipe = merge(recipe, yaml.safe_load(path.read_text()) or {})
    for assignment in overrides:
        recipe = override(recipe, assignment)
    return recipe
