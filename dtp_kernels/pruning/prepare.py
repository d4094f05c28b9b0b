"""DTP in training code that already exists: one call adds the pruner to a model and its
optimizer."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .pruner import DTPPruner, StepHooks
from .ratios import Ratios
from .zero_scores import ZeroScores, find_zero_optimizer


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper (Accelerate's and Lightning's keep it in
    ``.optimizer``); step hooks fire on it, not on the wrapper."""
    inner = optimizer
    while not type(inner).__module__.startswith("torch.optim") and hasattr(inner, "optimizer"):
        if type(inner).__module__.startswith("deepspeed.runtime.zero"):
            # its step walks the groups it partitioned when it was made: one more breaks it
            raise ValueError(
                f"optimizer is DeepSpeed's ZeRO optimizer ({type(inner).__name__}), which "
                "fixes its parameter groups when it is made: the pruner's scores cannot join "
                "it (prepare() and DTPTrainerCallback train them beside ZeRO stages 1 and 2)"
            )
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    return inner


# learning-rate schedulers that keep one entry per parameter group in these lists
PER_GROUP_LISTS = ("base_lrs", "_last_lr")
# schedulers whose per-group settings live in the groups themselves: no default for a new one
PER_GROUP_SETTINGS = (torch.optim.lr_scheduler.OneCycleLR, torch.optim.lr_scheduler.CyclicLR)


def _schedulers(scheduler) -> list:
    """The torch schedulers inside `scheduler` (wrappers keep one in ``.scheduler``;
    SequentialLR and ChainedScheduler hold several; a list is several)."""
    if isinstance(scheduler, (list, tuple)):
        return [s for part in scheduler for s in _schedulers(part)]
    while hasattr(scheduler, "scheduler") and not isinstance(
        scheduler, torch.optim.lr_scheduler.LRScheduler
    ):
        scheduler = scheduler.scheduler
    inner = getattr(scheduler, "_schedulers", None)
    return [s for part in inner for s in _schedulers(part)] if inner else [scheduler]


def _check_scheduler(scheduler) -> None:
    for part in _schedulers(scheduler):
        if isinstance(part, PER_GROUP_SETTINGS):
            raise ValueError(
                f"scheduler {type(part).__name__} keeps per-group settings that a new group of "
                "scores would lack; create it after prepare() instead of passing it"
            )
        if not isinstance(part, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(f"scheduler must be a torch LR scheduler, got {type(part).__name__}")


def _extend_scheduler(scheduler, lr: float, groups: int) -> None:
    """Give the scores' new group (the last of `groups`) the first group's schedule,
    scaled to `lr`. A list that has the entry already keeps it: a state saved with the
    scores' group, loaded into the scheduler of a resumed run before its pruner exists."""
    for part in _schedulers(scheduler):
        for name in PER_GROUP_LISTS:
            values = getattr(part, name, None)
            if isinstance(values, list) and len(values) < groups:
                values.append(lr)
        lambdas = getattr(part, "lr_lambdas", None)
        if isinstance(lambdas, list) and len(lambdas) < groups:
            first = lambdas[0]
            # a function, which LambdaLR's state_dict stores as None (a callable object's
            # state is stored): a state with this entry loads into a scheduler without it
            lambdas.append(lambda step, first=first: first(step))


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_inputs: torch.Tensor | tuple | Mapping,
    ratios: Ratios,
    *,
    score_lr: float | None = None,
    score_weight_decay: float = 0.0,
    scheduler=None,
    **pruner_kwargs,
) -> DTPPruner:
    """Prune `model` with DTP inside an existing training loop.

    Builds a :class:`DTPPruner` (``pruner_kwargs`` go to it), adds its scores (and, under
    ``budget="flops"``, its learned ratios) to `optimizer` as a parameter group of their
    own (none under ``scores="magnitude"``, where the weights are the scores), and
    commits the transport state after every ``optimizer.step()``. Nothing else
    changes in the loop; ``pruner.export()`` gives the smaller model at the end. (A loop
    that zeroes gradients with ``model.zero_grad()`` must also call
    ``pruner.zero_grad()``: the scores are the pruner's parameters, not the model's.)
    Under DeepSpeed, give the engine's optimizer: ZeRO stages 1 and 2 fix their groups,
    so the scores get an optimizer of their own, stepped after every ZeRO step.

    Args:
        score_lr: learning rate of the scores; default: that of the optimizer's first group.
            A learning-rate scheduler created before this call leaves it constant.
        score_weight_decay: weight decay of the scores (default 0: their size is what
            ranks the channels).
        scheduler: the learning-rate scheduler (or a list of them) made on `optimizer`
            before this call; the
            scores' group then follows the first group's schedule (a scheduler made after
            this call covers every group itself).
    """
    check_score_options(score_lr, score_weight_decay, scheduler, pruner_kwargs.get("scores"))
    if find_zero_optimizer(optimizer) is None:  # (ZeRO stage 3 refused there)
        unwrap_optimizer(optimizer)  # a wrong optimizer is refused before the model is touched
    pruner = DTPPruner(model, example_inputs, ratios, **pruner_kwargs)
    join_optimizer(
        pruner,
        optimizer,
        score_lr=score_lr,
        score_weight_decay=score_weight_decay,
        scheduler=scheduler,
    )
    return pruner


def check_score_options(score_lr, score_weight_decay, scheduler, scores) -> None:
    """ValueError or TypeError naming the first of prepare()'s own arguments out of range
    (`scores`: the pruner's score source)."""
    if score_lr is not None and not (isinstance(score_lr, (int, float)) and score_lr > 0):
        raise ValueError(f"score_lr = {score_lr!r}; it must be a number > 0")
    if not (isinstance(score_weight_decay, (int, float)) and score_weight_decay >= 0):
        raise ValueError(f"score_weight_decay = {score_weight_decay!r}; it must be >= 0")
    if scores == "magnitude" and score_lr is not None:
        raise ValueError(
            f"score_lr = {score_lr!r} with scores = 'magnitude': the scores are the weights' "
            "|w|, trained with the model's own learning rate; leave score_lr out"
        )
    if scheduler is not None:
        _check_scheduler(scheduler)


def join_optimizer(
    pruner: DTPPruner,
    optimizer: torch.optim.Optimizer,
    *,
    score_lr: float | None = None,
    score_weight_decay: float = 0.0,
    scheduler=None,
) -> StepHooks | ZeroScores:
    """The second half of :func:`prepare`, for a pruner made before the optimizer (a
    Lightning callback makes it before the Trainer makes the optimizers, so that a
    checkpoint's model and optimizer state load into their parametrized, extended
    forms): add its scores to `optimizer` as a group of their own and commit its
    state after every step. Arguments as for prepare(); returns the step hooks
    (:meth:`DTPPruner.attach`). DeepSpeed's ZeRO optimizer (stages 1 to 3; stage 3 with
    the pruner made before deepspeed.initialize) fixes its groups: the scores get an
    optimizer beside it (zero_scores.py), returned."""
    scores = "magnitude" if pruner.scores is None else "learned"  # (|w| under magnitude)
    check_score_options(score_lr, score_weight_decay, scheduler, scores)
    zero = find_zero_optimizer(optimizer, stage_3=True)  # (the pruner saw whole weights)
    if zero is not None:  # its groups are fixed: the scores get an optimizer beside it
        return ZeroScores(pruner, zero, score_lr=score_lr, score_weight_decay=score_weight_decay)
    inner = unwrap_optimizer(optimizer)
    # scores and learned ratios; no scores under scores="magnitude"
    params = [p for p in (pruner.scores, getattr(pruner, "theta", None)) if p is not None]
    if params:
        first = inner.param_groups[0]
        lr = float(score_lr) if score_lr is not None else first.get("initial_lr", first["lr"])
        group = {"params": params, "lr": lr, "weight_decay": score_weight_decay}
        if "initial_lr" in first:  # set by a scheduler: the new group starts where it would
            group["initial_lr"] = lr
            group["lr"] = lr * first["lr"] / first["initial_lr"] if first["initial_lr"] else lr
        inner.add_param_group(group)
        if scheduler is not None:
            _extend_scheduler(scheduler, lr, len(inner.param_groups))
    return pruner.attach(inner)
