"""The recipe's types, ranges and allowed values, checked whole before any work.

Every field of recipe.DEFAULTS has a check here. `validate` reports the first field
that fails, naming it, its value, where the value came from (the recipe file, a --set
override or the defaults) and what is allowed, as a RecipeError.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..pruning.nm import check_nm
from ..pruning.ratios import check_ratio_syntax
from .errors import RecipeError


@dataclass(frozen=True)
class Check:
    """One field's rule: `accepts(value)` and the words that say what is allowed."""

    accepts: Callable[[object], bool]
    allowed: str


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(low: int, optional: bool = False) -> Check:
    return Check(
        lambda v: (optional and v is None) or (_is_int(v) and v >= low),
        f"an integer >= {low}" + (" or null" if optional else ""),
    )


def number(
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> Check:
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    span = (
        f"{left}{low}, {high}{right}" if high is not None else f"{'>' if low_open else '>='} {low}"
    )

    def accepts(v: object) -> bool:
        if optional and v is None:
            return True
        if not _is_number(v) or not math.isfinite(v):
            return False
        above = v > low if low_open else v >= low
        below = high is None or (v < high if high_open else v <= high)
        return above and below

    return Check(accepts, f"a finite number {span}" + (" or null" if optional else ""))


def choice(*values: object) -> Check:
    return Check(
        lambda v: any(v == c and type(v) is type(c) for c in values), f"one of {list(values)}"
    )


def boolean(optional: bool = False) -> Check:
    return Check(
        lambda v: isinstance(v, bool) or (optional and v is None),
        "true or false" + (" or null" if optional else ""),
    )


def text(optional: bool = False, pattern: str | None = None, describe: str = "a string") -> Check:
    def accepts(v: object) -> bool:
        if optional and v is None:
            return True
        if not isinstance(v, str) or not v:
            return False
        return pattern is None or re.fullmatch(pattern, v) is not None

    return Check(accepts, describe + (" or null" if optional else ""))


def list_of(item: Check, what: str, optional: bool = False) -> Check:
    return Check(
        lambda v: (
            (optional and v is None) or (isinstance(v, list) and all(item.accepts(x) for x in v))
        ),
        f"a list of {what}" + (" or null" if optional else ""),
    )


def mapping() -> Check:
    return Check(lambda v: isinstance(v, Mapping), "a mapping of keyword arguments")


RATIO_FORMS = (
    "a ratio in [0, 1), a per-stage list such as [0, 0.5, 0.5, 0.5] (or the string "
    "'[0, 0.5, 0.5, 0.5]'), a layer map such as '[0:0, 1-15:0.5]', or a mapping from "
    "layer names, patterns or kinds to ratios"
)


def _ratio_problem(value: object) -> str | None:
    try:
        check_ratio_syntax(value)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def _nm_problem(value: object) -> str | None:
    try:
        check_nm(value)
    except ValueError as error:
        return str(error)
    return None


def ratios() -> Check:
    return Check(lambda v: _ratio_problem(v) is None, RATIO_FORMS)


SCHEDULE = choice("cosine", "step")
OPTIMIZER = choice("sgd", "adamw")
LR = number(0, low_open=True)
MOMENTUM = number(0, 1, high_open=True)
DECAY = number(0)
MILESTONES = list_of(integer(1), "epochs >= 1, increasing")
WARMUP = integer(0)
MAX_NORM = number(0, low_open=True, optional=True)
MAX_STEPS = integer(1, optional=True)

FIELDS: dict[str, Check] = {
    "seed": integer(0),
    "data.name": choice("digits", "cifar10", "cifar100", "imagefolder", "text"),
    "data.root": text(optional=True, describe="a directory"),
    "data.batch_size": integer(1),
    "data.eval_batch_size": integer(1),
    "data.accumulate": integer(1),
    "data.augment": boolean(),
    "data.image_size": integer(1),
    "data.num_workers": integer(0, optional=True),
    "data.pin_memory": boolean(optional=True),
    "data.persistent_workers": boolean(),
    "data.prefetch_factor": integer(1, optional=True),
    "data.skip_bad_files": boolean(),
    "data.seq_len": integer(1),
    "data.tokenizer": choice("model", "bytes", "pretokenized"),
    "model.name": text(describe="a model name"),
    "model.num_classes": integer(1),
    "model.source": choice("builtin", "torchvision", "python", "huggingface"),
    "model.entry": text(
        optional=True, pattern=r"[\w.]+:[\w.]+", describe="'package.module:function'"
    ),
    "model.kwargs": mapping(),
    "model.weights": text(optional=True, describe="a file, or 'random'"),
    "model.input_shape": list_of(integer(1), "sizes >= 1", optional=True),
    "model.path": text(optional=True, describe="a directory"),
    "model.dtype": choice("float32", "bfloat16"),
    "model.optimizer_state_dtype": choice("float32", "bfloat16"),
    "pretrain.epochs": integer(0),
    "pretrain.optimizer": OPTIMIZER,
    "pretrain.lr": LR,
    "pretrain.momentum": MOMENTUM,
    "pretrain.weight_decay": DECAY,
    "pretrain.warmup_steps": WARMUP,
    "pretrain.max_grad_norm": MAX_NORM,
    "pretrain.max_steps": MAX_STEPS,
    "prune.method": choice("dtp", "l1", "random"),
    "prune.ratios": ratios(),
    "prune.budget": choice("layer", "global", "flops"),
    "prune.granularity": choice("filter", "weight", "n:m"),
    "prune.nm": Check(
        lambda v: isinstance(v, list) and _nm_problem(v) is None,
        "[N, M] with 1 <= N < M and M in [4, 8, 16]",
    ),
    "prune.scores": choice("learned", "magnitude"),
    "prune.eps": number(0, low_open=True),
    "prune.iters": integer(1),
    "prune.skip": list_of(text(), "module names or globs"),
    "prune.epochs": integer(0),
    "prune.optimizer": OPTIMIZER,
    "prune.lr": LR,
    "prune.momentum": MOMENTUM,
    "prune.weight_decay": DECAY,
    "prune.schedule": SCHEDULE,
    "prune.flops_target": number(0, 1, low_open=True, optional=True),
    "prune.penalty_weight": number(0),
    "prune.warmup_steps": WARMUP,
    "prune.max_grad_norm": MAX_NORM,
    "prune.max_steps": MAX_STEPS,
    "prune.train_weights": boolean(),
    "finetune.epochs": integer(0),
    "finetune.optimizer": OPTIMIZER,
    "finetune.lr": LR,
    "finetune.momentum": MOMENTUM,
    "finetune.weight_decay": DECAY,
    "finetune.schedule": SCHEDULE,
    "finetune.milestones": MILESTONES,
    "finetune.gamma": number(0, 1, low_open=True),
    "finetune.warmup_steps": WARMUP,
    "finetune.max_grad_norm": MAX_NORM,
    "finetune.max_steps": MAX_STEPS,
    "run.device": text(pattern=r"auto|cpu|cuda(:\d+)?", describe="auto, cpu, cuda or cuda:N"),
    "run.amp": choice(None, "bf16", "fp16"),
    "run.channels_last": boolean(),
    "run.compile": boolean(),
    "run.activation_checkpointing": boolean(),
    "run.progress": boolean(),
    "run.tensorboard": boolean(),
    "run.plots": boolean(),
    "run.checkpoint_minutes": number(0, low_open=True, optional=True),
    "run.checkpoint_steps": integer(1, optional=True),
    "run.eval_every_steps": integer(1, optional=True),
    "run.sharding": choice(None, "fsdp"),
    "run.shard_units": list_of(text(), "module names or globs"),
}


def flatten(recipe: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"section.key": value} of every field that has a check (model.kwargs stays whole)."""
    out = {}
    for key, value in recipe.items():
        name = prefix + key
        if isinstance(value, Mapping) and name not in FIELDS:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _source(name: str, sources: Mapping[str, str] | None) -> str:
    return "the recipe" if sources is None else sources.get(name, "the defaults")


def _fail(name: str, value: object, sources: Mapping[str, str] | None, allowed: str) -> RecipeError:
    where = _source(name, sources)
    reason = _ratio_problem(value) if name == "prune.ratios" else None
    because = f" ({reason})" if reason else ""
    return RecipeError(
        f"{name} = {value!r} (from {where}) is not allowed{because}: it must be {allowed}"
    )


def validate(recipe: Mapping, sources: Mapping[str, str] | None = None) -> None:
    """Raise RecipeError for the first field whose type, range or value is not allowed,
    then for combinations that cannot run. `sources` maps a field to where it was set."""
    values = flatten(recipe)
    for name, check in FIELDS.items():
        if name not in values:
            raise RecipeError(f"the recipe has no field {name}")
        if not check.accepts(values[name]):
            raise _fail(name, values[name], sources, check.allowed)
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise RecipeError(f"unknown recipe fields {unknown}; known: {sorted(FIELDS)}")
    milestones = values["finetune.milestones"]
    if milestones != sorted(set(milestones)):
        raise _fail("finetune.milestones", milestones, sources, "strictly increasing")
    if values["prune.budget"] == "flops" and values["prune.flops_target"] is None:
        raise RecipeError(
            f"prune.budget = 'flops' (from {_source('prune.budget', sources)}) "
            "needs prune.flops_target, the fraction of dense FLOPs to keep, in (0, 1]"
        )
    if values["prune.flops_target"] is not None and values["prune.budget"] != "flops":
        raise RecipeError(
            f"prune.flops_target = {values['prune.flops_target']!r} is only used with "
            f"prune.budget = 'flops', but the budget is {values['prune.budget']!r}"
        )
    if values["prune.method"] == "dtp" and values["prune.epochs"] < 1:
        raise RecipeError(
            f"prune.epochs = {values['prune.epochs']} (from "
            f"{_source('prune.epochs', sources)}) with prune.method = 'dtp': DTP "
            "learns its masks while training, so it needs prune.epochs >= 1 (or use "
            "prune.method=l1 or random for one-shot pruning)"
        )
    if values["prune.granularity"] != "filter" and values["prune.method"] == "random":
        raise RecipeError(
            f"prune.granularity = {values['prune.granularity']!r} needs prune.method dtp or "
            "l1 (one-shot magnitude); random prunes filters"
        )
    if values["prune.scores"] == "magnitude" and values["prune.granularity"] == "filter":
        raise RecipeError(
            f"prune.scores = 'magnitude' (from {_source('prune.scores', sources)}) scores "
            "each weight by |w|: it needs prune.granularity weight or n:m, not filter"
        )
    if values["model.source"] == "python" and values["model.entry"] is None:
        raise RecipeError("model.source = 'python' needs model.entry = 'package.module:function'")
    if not values["prune.train_weights"] and (
        values["prune.method"] != "dtp" or values["prune.scores"] != "learned"
    ):
        raise RecipeError(
            f"prune.train_weights = false (from {_source('prune.train_weights', sources)}) "
            "freezes the weights while DTP learns its masks: it needs prune.method = 'dtp' "
            f"with prune.scores = 'learned', not {values['prune.method']!r} with "
            f"{values['prune.scores']!r} (nothing would train)"
        )
    if values["model.optimizer_state_dtype"] == "bfloat16" and values["model.dtype"] != "bfloat16":
        raise RecipeError(
            f"model.optimizer_state_dtype = 'bfloat16' (from "
            f"{_source('model.optimizer_state_dtype', sources)}) needs model.dtype = "
            "'bfloat16': float32 weights keep float32 optimizer state"
        )
    _check_huggingface(values, sources)
    _check_sharding(values, sources)


def _check_sharding(values: Mapping, sources: Mapping[str, str] | None) -> None:
    """run.sharding 'fsdp' trains every stage sharded; what it does not cover is
    refused here, before any work."""
    if values["run.sharding"] is None:
        if values["run.shard_units"]:
            raise RecipeError(
                f"run.shard_units = {values['run.shard_units']!r} (from "
                f"{_source('run.shard_units', sources)}) names FSDP's units: it needs "
                "run.sharding = 'fsdp'"
            )
        return
    where = f"run.sharding = 'fsdp' (from {_source('run.sharding', sources)})"
    conflicts = [  # (field, what it is, what sharding needs)
        ("run.amp", values["run.amp"] == "fp16", "'bf16' or null"),
        ("prune.granularity", values["prune.granularity"] != "filter", "'filter'"),
    ]
    for name, conflict, needed in conflicts:
        if conflict:
            raise RecipeError(
                f"{where} trains every stage sharded, which does not "
                f"cover {name} = {values[name]!r} (from {_source(name, sources)}); "
                f"allowed with it: {needed}"
            )


def _check_huggingface(values: Mapping, sources: Mapping[str, str] | None) -> None:
    """data.name 'text' and run.activation_checkpointing need model.source 'huggingface';
    that source needs model.path and no separate weights; text takes no channels_last."""
    text, hugging = values["data.name"] == "text", values["model.source"] == "huggingface"
    if text and not hugging:
        raise RecipeError(
            f"data.name = 'text' (from {_source('data.name', sources)}) needs model.source "
            "= 'huggingface': text trains a causal language model, saved with "
            "save_pretrained in model.path"
        )
    if not hugging:
        if values["model.dtype"] != "float32":
            raise RecipeError(
                f"model.dtype = {values['model.dtype']!r} (from "
                f"{_source('model.dtype', sources)}) needs model.source = 'huggingface'; "
                "other sources train float32 weights (run.amp gives bf16 compute)"
            )
        if values["run.activation_checkpointing"]:
            raise RecipeError(
                f"run.activation_checkpointing = true (from "
                f"{_source('run.activation_checkpointing', sources)}) needs model.source = "
                "'huggingface' (transformers' activation_checkpointing_enable); in your own "
                "code wrap blocks in torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        return
    if values["model.path"] is None:
        raise RecipeError(
            "model.source = 'huggingface' needs model.path, the directory the model was "
            "saved to with save_pretrained (config.json and the weights)"
        )
    if values["model.weights"] is not None:
        raise RecipeError(
            f"model.weights = {values['model.weights']!r} (from "
            f"{_source('model.weights', sources)}): a huggingface model's weights are read "
            "from model.path; leave model.weights null"
        )
    if text and values["run.channels_last"]:
        raise RecipeError("run.channels_last is for images; a language model's inputs are tokens")
    given = [key for key in ("dtype", "torch_dtype") if key in values["model.kwargs"]]
    if given:
        raise RecipeError(
            f"model.kwargs.{given[0]} (from {_source('model.kwargs', sources)}): give the "
            "parameters' type as model.dtype (float32 or bfloat16)"
        )
    if values["model.dtype"] == "bfloat16" and values["run.amp"] == "fp16":
        raise RecipeError(
            f"run.amp = 'fp16' (from {_source('run.amp', sources)}) with model.dtype = "
            "'bfloat16': fp16 compute would round bfloat16 weights to fp16; use run.amp = "
            "'bf16' or null"
        )
