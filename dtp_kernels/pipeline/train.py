"""Training stages: SGD with momentum and weight decay, cosine or step schedules, the DTP
pruner's scores in their own parameter group, metrics as JSONL lines."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from . import distributed, sharding
from .checkpoint import (
    CheckpointError,
    check_state_dict,
    load_checkpoint,
    make_payload,
    save_atomic,
)
from .compensated_optim import LOW_PRECISION, CompensatedAdamW, CompensatedSGD
from .data import epoch_sampler
from .errors import DivergedError, UsageError
from .preemption import Preempted, PreemptionGuard
from .step import compile_model, training_step

if TYPE_CHECKING:
    from ..pruning.pruner import DTPPruner

TASKS = ("classify", "causal_lm")
OPTIMIZERS = ("sgd", "adamw")


class MetricsLog:
    """Appends one JSON object per line to `path` (or keeps them in memory only), and
    the numbers to TensorBoard under `tensorboard_dir` when tensorboard is installed."""

    def __init__(self, path: Path | None = None, tensorboard_dir: Path | None = None) -> None:
        self.path, self.writer = path, None
        self.rows: list[dict] = []
        if tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard_dir))

    def write(self, **row) -> None:
        row = _finite_or_null(row)  # NaN and Inf are not JSON: they are written as null
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")
        if self.writer is not None:
            # an evaluation within an epoch (run.eval_every_steps) is plotted against the
            # optimizer step, under tags of its own; the epochs' against the epoch
            where, x = (
                (f"{row['stage']}/steps", row["step"])
                if "step" in row
                else (row["stage"], row.get("epoch", 0))
            )
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("epoch", "step"):
                    self.writer.add_scalar(f"{where}/{key}", value, x)
            self.writer.flush()

    def restore(self, rows: list[dict]) -> None:
        """Replace the rows (and the file) with those of a checkpoint: rows written after
        it by a run that was then killed are dropped."""
        self.rows = [dict(row) for row in rows]
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
            os.replace(tmp, self.path)


def _finite_or_null(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_null(v) for v in value]
    return value


@dataclass
class RunOptions:
    """How stages run: the device, mixed precision ("bf16", "fp16" or None),
    channels_last memory format, torch.compile of the training step, tqdm progress bars,
    how often a checkpoint is written within an epoch (minutes and/or steps; None: not
    within epochs), the guard that stops a stage at a preemption signal, the task:
    "classify" (the model returns class logits) or "causal_lm" (a transformers causal
    language model: its logits per token, against the next tokens), `accumulate`, the
    batches whose gradients make one optimizer step (data.accumulate), and
    `eval_every_steps`, how often (in optimizer steps) to evaluate within an epoch too,
    `optimizer_state_dtype`, the optimizer state's dtype for low-precision weights
    (None: the weights' own; model.optimizer_state_dtype), and `sharding` ("fsdp" or
    None: run.sharding) with `shard_units` (run.shard_units)."""

    amp: str | None = None
    channels_last: bool = False
    progress: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    compile: bool = False
    preemption: PreemptionGuard | None = None
    checkpoint_minutes: float | None = None
    checkpoint_steps: int | None = None
    eval_every_steps: int | None = None
    task: str = "classify"
    accumulate: int = 1
    optimizer_state_dtype: torch.dtype | None = torch.float32
    sharding: str | None = None
    shard_units: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        count = self.accumulate
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise UsageError(f"data.accumulate = {count!r}; allowed: an integer >= 1")
        if self.amp not in (None, "bf16", "fp16"):
            raise UsageError(f"run.amp = {self.amp!r}; allowed: null, 'bf16', 'fp16'")
        if self.task not in TASKS:
            raise UsageError(f"task = {self.task!r}; allowed: {list(TASKS)}")
        self.device = torch.device(self.device)

    def outputs(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """The model's logits on `inputs` with the classes in dim 1: a causal language
        model's (batch, vocabulary, tokens), without its key/value cache; a Hugging Face
        classifier's `logits`."""
        if self.task == "causal_lm":
            return model(inputs, use_cache=False).logits.transpose(1, 2)
        out = model(inputs)
        return out if isinstance(out, torch.Tensor) else out.logits

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.amp]

    def images(self, images: torch.Tensor) -> torch.Tensor:
        """A batch of inputs on the run's device (asynchronously from pinned memory), in
        its memory format."""
        images = images.to(self.device, non_blocking=True)
        return images.to(memory_format=torch.channels_last) if self.channels_last else images

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        return labels.to(self.device, non_blocking=True)


def evaluate(model: nn.Module, loader: DataLoader, options: RunOptions | None = None) -> float:
    """Top-1 accuracy in [0, 1] (a language model's: of the next token, over every
    position), counted on the device (one read at the end)."""
    return _test_pass(model, loader, options or RunOptions())["accuracy"]


@torch.no_grad()
def _test_pass(
    model: nn.Module, loader: DataLoader, options: RunOptions, perplexity: bool = False
) -> dict:
    """{"accuracy"} and, with `perplexity`, {"perplexity"} over every target of `loader`,
    summed on the device (the loss in float64; one read at the end)."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=options.device)
    loss = torch.zeros((), dtype=torch.float64, device=options.device)
    count = 0
    for inputs, targets in loader:
        logits = options.outputs(model, options.images(inputs))
        targets = options.labels(targets)
        correct += (logits.argmax(1) == targets).sum()
        if perplexity:
            loss += nn.functional.cross_entropy(logits.float(), targets, reduction="sum").double()
        count += targets.numel()
    model.train(was_training)
    if sharding.is_sharded(model):
        # FSDP's root keeps its weights gathered after a forward that no backward follows;
        # its parameters must be the shards again (the optimizer holds those)
        sharding.reshard(model)
    result = {"accuracy": int(correct) / max(count, 1)}
    if perplexity:
        result["perplexity"] = math.exp(float(loss) / max(count, 1))
    return result


def metrics(model: nn.Module, loader: DataLoader, options: RunOptions) -> dict:
    """What a stage reports on the test set: {"accuracy"}, and for a causal language
    model {"accuracy" (of the next token), "perplexity" (exp of the mean cross-entropy)},
    in one pass."""
    return _test_pass(model, loader, options, perplexity=options.task == "causal_lm")


def make_optimizer(
    model: nn.Module,
    settings: dict,
    pruner: DTPPruner | None = None,
    state_dtype: torch.dtype | None = torch.float32,
):
    """The stage's optimizer (settings["optimizer"]: "sgd", the default, or "adamw").

    When weights that train are bfloat16 or float16 (model.dtype), it is the
    compensated version (compensated_optim.py), so updates below a weight's spacing add
    up instead of rounding away, with its moments or momentum in `state_dtype` (None:
    the weights' dtype)."""
    groups: list[dict[str, Any]] = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    low = any(p.dtype in LOW_PRECISION for p in groups[0]["params"])
    # the pruner's scores and learned ratios (none for magnitude scores): no weight decay
    extra = list(pruner.parameters()) if pruner is not None else []
    if extra:
        groups.append({"params": extra, "weight_decay": 0.0})
    kind = settings.get("optimizer", "sgd")
    if kind not in OPTIMIZERS:
        raise UsageError(f"optimizer = {kind!r}; allowed: {list(OPTIMIZERS)}")
    # the compensated optimizers' state dtype (torch's optimizers take none)
    state: dict[str, Any] = {"state_dtype": state_dtype} if low else {}
    if kind == "adamw":
        return (CompensatedAdamW if low else torch.optim.AdamW)(
            groups, lr=settings["lr"], weight_decay=settings.get("weight_decay", 0.01), **state
        )
    return (CompensatedSGD if low else torch.optim.SGD)(
        groups,
        lr=settings["lr"],
        momentum=settings.get("momentum", 0.9),
        weight_decay=settings.get("weight_decay", 5e-4),
        **state,
    )


def make_schedule(
    optimizer: torch.optim.Optimizer, settings: dict, steps: int, per_epoch: int | None = None
):
    """The stage's learning-rate schedule over `steps` optimizer steps: "cosine" to 0, or
    "step" (x gamma at each of `milestones`, in epochs of `per_epoch` optimizer steps;
    default: `steps` over the stage's epochs); with `warmup_steps` = w > 0, times a
    linear warm-up from 1/(w+1) to 1 over the first w steps."""
    main: torch.optim.lr_scheduler.LRScheduler
    if settings.get("schedule", "cosine") == "cosine":
        main = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))
    else:
        per_epoch = per_epoch or max(steps // max(settings["epochs"], 1), 1)
        milestones = [m * per_epoch for m in settings.get("milestones", [])]
        main = torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones, settings.get("gamma", 0.1)
        )
    warmup = settings.get("warmup_steps", 0)
    if not warmup:
        return main
    # both multiply the learning rate step by step, so chained they give the product
    ramp = torch.optim.lr_scheduler.LinearLR(optimizer, 1 / (warmup + 1), total_iters=warmup)
    return torch.optim.lr_scheduler.ChainedScheduler([ramp, main], optimizer)


def accumulation_plan(samples: int, batch: int, accumulate: int) -> list[tuple[float, bool, bool]]:
    """For each batch of an epoch (`samples` samples on this rank, in batches of `batch`,
    the last one possibly smaller): its share of its optimizer step's samples, whether it
    opens the step and whether it closes it. Steps take `accumulate` batches in order; an
    epoch's last step takes what is left. Weighting by samples makes a step's gradient
    that of one batch of all its samples (for a loss that is a mean over samples)."""
    sizes = [min(batch, samples - start) for start in range(0, samples, batch)]
    plan = []
    for begin in range(0, len(sizes), accumulate):
        group = sizes[begin : begin + accumulate]
        total = sum(group)
        plan += [(n / total, i == 0, i == len(group) - 1) for i, n in enumerate(group)]
    return plan


def stage_steps(plan: list[tuple[float, bool, bool]], settings: dict) -> int:
    """The optimizer steps of a stage whose epochs follow `plan` (accumulation_plan):
    its epochs', or settings["max_steps"] if that is fewer."""
    every = settings["epochs"] * sum(last for _, _, last in plan)
    return min(every, settings.get("max_steps") or every)


@dataclass
class Checkpointing:
    """Where a stage's checkpoint goes, what it must match, and whether to resume."""

    path: Path
    meta: dict
    resume: bool = False


def hold_at_zero(optimizer: torch.optim.Optimizer, kept: dict[torch.Tensor, torch.Tensor]):
    """After every optimizer step, set the entries of each parameter that `kept` (boolean
    masks of the kept entries) marks as pruned back to zero; returns the hook's handle."""
    params, masks = list(kept), [m.to(p.dtype) for p, m in kept.items()]
    return optimizer.register_step_post_hook(
        lambda *_: torch._foreach_mul_([p.data for p in params], masks)
    )


def train(
    model: nn.Module,
    train_loader: DataLoader,
    test_loader: DataLoader,
    settings: dict,
    log: MetricsLog,
    stage: str,
    pruner: DTPPruner | None = None,
    flops_target: float | None = None,
    checkpoint: Checkpointing | None = None,
    options: RunOptions | None = None,
    on_epoch: Callable[[int], None] | None = None,
    keep_zero: dict[torch.Tensor, torch.Tensor] | None = None,
) -> dict:
    """Train for settings["epochs"], or settings["max_steps"] optimizer steps if that
    ends sooner (the last epoch then cut short); log the loss and the test metrics
    (`metrics`) per epoch run; return the summary.

    keep_zero maps parameters to boolean masks of their kept entries; the others are set
    back to zero after every optimizer step (fine-tuning an unstructured pruned model).

    With `checkpoint`, the stage is saved after every epoch (and at a preemption signal,
    after the current step); with `checkpoint.resume` and a checkpoint present, it
    continues from there (a finished stage returns at once) and ends bitwise where an
    uninterrupted run ends. The loader's sampler must be an EpochSampler (data.loaders).

    With `options.accumulate` = k > 1, every k batches make one optimizer step (their
    gradients weighted by their samples); the schedule counts optimizer steps, and
    checkpoints and preemption stops fall between optimizer steps.

    A model FSDP2 shards (sharding.shard, before this call) trains as it is, not in DDP;
    its checkpoints hold whole tensors, as an unsharded model's do.
    """
    options = options or RunOptions()
    steps = len(train_loader)
    sampler, batch = epoch_sampler(train_loader)
    if options.accumulate > steps:
        raise UsageError(
            f"data.accumulate = {options.accumulate} is more than the {steps} batches of an "
            f"epoch{' on each rank' if distributed.active() else ''}; allowed: 1 to {steps} "
            "(or lower data.batch_size)"
        )
    plan = accumulation_plan(len(sampler), batch, options.accumulate)
    updates = sum(last for _, _, last in plan)
    total = stage_steps(plan, settings)
    # the last epoch run ends after `cut` batches, the batch that closes its last step
    run_epochs = -(-total // updates)
    closing = [index + 1 for index, (_, _, last) in enumerate(plan) if last]
    cut = closing[total - (run_epochs - 1) * updates - 1] if total else steps
    # the optimizer steps an epoch has made when batch b (counted from 1) closes one
    made = {batches: number for number, batches in enumerate(closing, start=1)}

    def batches(epoch: int) -> int:
        return cut if epoch == run_epochs - 1 else steps

    if options.channels_last:
        model.to(memory_format=torch.channels_last)
    scaler = torch.amp.GradScaler(options.device.type) if options.amp == "fp16" else None
    sharded = sharding.is_sharded(model)  # FSDP2 (run.sharding): no DDP around it
    if sharded:  # the optimizer takes the shards, not gathered weights
        sharding.reshard(model)
    optimizer = make_optimizer(model, settings, pruner, options.optimizer_state_dtype)
    schedule = make_schedule(optimizer, settings, total, per_epoch=updates)
    if pruner is not None:  # (under torchrun it averages the scores' gradients over ranks)
        pruner.attach(optimizer)
    if keep_zero:
        hold_at_zero(optimizer, keep_zero)
    first_epoch, first_step, seconds = 0, 0, 0.0
    # The epoch's losses, one per step, kept on the device (no host sync per step): their
    # mean is the logged loss, and a NaN or Inf among them stops the stage.
    losses = torch.zeros(steps, device=options.device)
    if checkpoint is not None and checkpoint.resume and checkpoint.path.exists():
        saved = _restore(checkpoint, model, optimizer, schedule, pruner, log, options)
        if scaler is not None and saved.get("scaler") is not None:
            scaler.load_state_dict(saved["scaler"])
        if saved["done"]:
            return saved["result"]
        first_epoch, first_step, seconds = saved["epoch"], saved["step"], saved["seconds"]
        losses = saved["losses"].to(options.device)
    start = time.perf_counter() - seconds
    model.train()
    bar = tqdm(
        total=(run_epochs - 1) * steps + cut if run_epochs else 0,
        initial=first_epoch * steps + first_step,
        desc=stage,
        disable=not options.progress,
        leave=False,
    )
    max_norm = settings.get("max_grad_norm")
    clip: tuple[list[torch.Tensor], float] | None = (
        ([p for p in model.parameters() if p.requires_grad], max_norm) if max_norm else None
    )
    net = ddp = model if sharded else distributed.wrap(model)
    if options.compile:  # default mode: the pruner's hooks and ops trace without breaks
        net = compile_model(net)
    guard = options.preemption
    result: dict[str, Any] = {}

    def check_losses(epoch: int, upto: int) -> None:
        """DivergedError if a loss of this epoch's steps [0, upto) is NaN or Inf."""
        bad = ~torch.isfinite(losses[:upto])
        if bool(bad.any()):
            step = int(bad.nonzero()[0])
            kept = (
                f"its last checkpoint {checkpoint.path} is kept" if checkpoint else "nothing saved"
            )
            raise DivergedError(
                f"{stage}: the training loss is {float(losses[step])} at epoch {epoch}, step "
                f"{step} of {steps}; the stage stopped ({kept}). Lower {_section(stage)}.lr, "
                "or check the data and the model's weights"
            )

    last_save: tuple[float, int]  # (monotonic seconds, steps) of the last checkpoint

    def save(epoch: int, step: int, done: bool) -> None:
        nonlocal last_save
        last_save = (time.monotonic(), epoch * steps + step)
        if checkpoint is None:
            return
        if sharded:  # every rank gathers the shards, tensor by tensor; rank 0 keeps them
            keep = distributed.is_main()
            weights = sharding.model_state(model, keep)
            moments = sharding.optimizer_state(optimizer, keep)
        if not distributed.is_main():
            return
        if not sharded:
            weights, moments = model.state_dict(), optimizer.state_dict()
        save_atomic(
            make_payload(
                checkpoint.meta,
                epoch=epoch,
                step=step,
                done=done,
                result=result,
                seconds=time.perf_counter() - start,
                losses=losses.cpu(),
                model=weights,
                optimizer=moments,
                scheduler=schedule.state_dict(),
                pruner=pruner.state_dict() if pruner is not None else None,
                rng=torch.get_rng_state(),
                cuda_rng=_cuda_rng(options.device),
                scaler=scaler.state_dict() if scaler is not None else None,
                log_rows=log.rows,
            ),
            checkpoint.path,
        )

    # (not `every`: the loop below binds that name to eval_every_steps, and due() reads it)
    minutes, steps_apart = options.checkpoint_minutes, options.checkpoint_steps
    # A sharded model's checkpoint is gathered by every rank, so every rank must find it
    # due at the same step; the clocks of the ranks differ, the step counts do not.
    agree = (
        distributed.Agreement()
        if sharded and distributed.active() and checkpoint is not None and minutes is not None
        else None
    )

    def due(epoch: int, step: int) -> bool:
        """A mid-epoch checkpoint is due (run.checkpoint_minutes / checkpoint_steps)."""
        if checkpoint is None:
            return False
        late = minutes is not None and time.monotonic() - last_save[0] >= 60 * minutes
        if agree is not None:
            late = bool(agree(late))
        apart = epoch * steps + step - last_save[1]
        return (steps_apart is not None and apart >= steps_apart) or late

    last_save = (time.monotonic(), first_epoch * steps + first_step)
    for epoch in range(first_epoch, run_epochs):
        length = batches(epoch)
        begin = first_step if epoch == first_epoch else 0
        sampler.set_epoch(epoch, start=begin * batch)
        # the epoch's batches from `begin` to `length` (fewer than all under max_steps)
        left = itertools.islice(enumerate(train_loader, start=begin), max(length - begin, 0))
        for step, (images, labels) in left:
            weight, first, last = plan[step]
            # DDP all-reduces (FSDP reduce-scatters) the gradients at the backward of an
            # optimizer step's last batch only; the others accumulate locally.
            sync: contextlib.AbstractContextManager[None]
            if sharded:
                sync = sharding.gradient_sync(model, last)
            elif not last and isinstance(ddp, nn.parallel.DistributedDataParallel):
                sync = ddp.no_sync()
            else:
                sync = contextlib.nullcontext()
            with sync:
                loss = training_step(
                    net,
                    optimizer,
                    options.images(images),
                    options.labels(labels),
                    pruner,
                    flops_target,
                    settings.get("penalty_weight", 10.0),
                    options.amp_dtype,
                    scaler,
                    options.outputs,
                    weight=weight,
                    first=first,
                    last=last,
                    clip=clip,
                )
            bar.update()
            losses[step] = loss.detach().float()
            if not last:
                continue
            schedule.step()
            # before a stop's checkpoint, which then holds the line, as a resumed run would
            every = options.eval_every_steps
            done = epoch * updates + made[step + 1]
            if every and done % every == 0 and step + 1 < length:  # the epoch's end evaluates
                scores = metrics(model, test_loader, options)
                mean = losses[: step + 1].sum().item() / (step + 1)  # the epoch's so far
                log.write(stage=stage, epoch=epoch, step=done, loss=mean, **scores)
            signum = guard.requested() if guard is not None else None
            if signum:
                check_losses(epoch, step + 1)
                save(epoch, step + 1, False)
                bar.close()
                where = checkpoint.path if checkpoint is not None else None
                raise Preempted(signum, stage, epoch, step + 1, where)
            if step + 1 < length and due(epoch, step + 1):
                check_losses(epoch, step + 1)
                save(epoch, step + 1, False)
        check_losses(epoch, length)
        scores = metrics(model, test_loader, options)
        log.write(stage=stage, epoch=epoch, loss=losses.sum().item() / length, **scores)
        losses = torch.zeros(steps, device=options.device)
        if on_epoch is not None:
            on_epoch(epoch)
        result = {"seconds": time.perf_counter() - start, **scores}
        save(epoch + 1, 0, epoch + 1 == run_epochs)
    bar.close()
    if agree is not None:
        agree.close()
    if first_epoch < run_epochs:  # the last epoch's evaluation: no second pass over the test set
        return result
    return {
        "seconds": time.perf_counter() - start,
        **metrics(model, test_loader, options),
    }


def _section(stage: str) -> str:
    """The recipe section of a stage label ("dtp-0.5" -> "prune")."""
    head = stage.split("-")[0]
    return {"dtp": "prune"}.get(head, head)


def _cuda_rng(device: torch.device) -> torch.Tensor | None:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _restore(checkpoint: Checkpointing, model, optimizer, schedule, pruner, log, options) -> dict:
    """Load a stage checkpoint into the run's objects, after checking all of it. Tensors
    are read on the CPU and copied to the run's device, so a checkpoint written on one
    device resumes on another."""
    saved = load_checkpoint(checkpoint.path, checkpoint.meta)
    check_state_dict(model, saved["model"], "model", checkpoint.path)
    if pruner is not None:
        if saved["pruner"] is None:
            raise CheckpointError(f"{checkpoint.path} holds no pruner state")
        check_state_dict(pruner, saved["pruner"], "pruner state", checkpoint.path)
    if sharding.is_sharded(model):  # whole tensors, cut into this rank's shards
        sharding.load_model_state(model, saved["model"])
    else:
        model.load_state_dict(saved["model"])
    if pruner is not None:
        pruner.load_state_dict(saved["pruner"])
    if sharding.is_sharded(model):
        sharding.load_optimizer_state(optimizer, saved["optimizer"])
    else:  # (moves its state to the parameters' device)
        optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    if options.device.type == "cuda" and saved.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"], options.device)
    log.restore(saved["log_rows"])
    return saved
