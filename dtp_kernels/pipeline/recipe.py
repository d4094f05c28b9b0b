"""Recipes: YAML files in configs/ with the paper's training settings; any field can be
overridden as `section.key=value` (the value is read as YAML)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

DEFAULTS = {
    "seed": 0,
    "data": {"name": "digits", "root": None, "batch_size": 64},
    "model": {"name": "digits_cnn", "num_classes": 10},
    "pretrain": {"epochs": 0, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
    "prune": {"method": "dtp", "ratios": 0.5, "budget": "layer", "eps": 1.0, "iters": 1,
              "epochs": 10, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
              "schedule": "cosine", "flops_target": None},
    "finetune": {"epochs": 10, "lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4,
                 "schedule": "step", "milestones": [], "gamma": 0.1},
    # amp: null, "bf16" or "fp16" (torch.autocast; fp16 with a GradScaler)
    "run": {"amp": None, "channels_last": False, "progress": True, "tensorboard": True,
            "plots": True},
}  # fmt: skip


def merge(base: dict, update: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if key not in out:
            raise ValueError(f"unknown recipe field '{where}{key}'; known: {sorted(out)}")
        if isinstance(out[key], dict) and isinstance(value, dict):
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
