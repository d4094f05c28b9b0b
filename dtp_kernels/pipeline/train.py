"""Training stages: SGD with momentum and weight decay, cosine or step schedules, the DTP
pruner's scores in their own parameter group, metrics as JSONL lines."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from . import distributed
from .checkpoint import (
    CheckpointError,
    check_state_dict,
    load_checkpoint,
    make_payload,
    save_atomic,
)
from .step import training_step


class MetricsLog:
    """Appends one JSON object per line to `path` (or keeps them in memory only), and
    the numbers to TensorBoard under `tensorboard_dir` when tensorboard is installed."""

    def __init__(self, path: Path | None = None, tensorboard_dir: Path | None = None) -> None:
        self.path, self.rows, self.writer = path, [], None
        if tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard_dir))

    def write(self, **row) -> None:
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "epoch":
                    self.writer.add_scalar(f"{row['stage']}/{key}", value, row.get("epoch", 0))
            self.writer.flush()

    def restore(self, rows: list[dict]) -> None:
        """Replace the rows (and the file) with those of a checkpoint: rows written after
        it by a run that was then killed are dropped."""
        self.rows = [dict(row) for row in rows]
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
            os.replace(tmp, self.path)


@dataclass
class RunOptions:
    """How stages run: mixed precision ("bf16", "fp16" or None), channels_last memory
    format, tqdm progress bars."""

    amp: str | None = None
    channels_last: bool = False
    progress: bool = False

    def __post_init__(self) -> None:
        if self.amp not in (None, "bf16", "fp16"):
            raise ValueError(f"run.amp = {self.amp!r}; allowed: null, 'bf16', 'fp16'")

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.amp]

    def images(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(memory_format=torch.channels_last) if self.channels_last else images


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, options: RunOptions | None = None) -> float:
    """Top-1 accuracy in [0, 1]."""
    options = options or RunOptions()
    was_training = model.training
    model.eval()
    correct = total = 0
    for images, labels in loader:
        correct += int((model(options.images(images)).argmax(1) == labels).sum())
        total += len(labels)
    model.train(was_training)
    return correct / max(total, 1)


def make_optimizer(model: nn.Module, settings: dict, pruner: nn.Module | None = None):
    groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if pruner is not None:  # scores and learned ratios: no weight decay
        groups.append({"params": list(pruner.parameters()), "weight_decay": 0.0})
    return torch.optim.SGD(
        groups,
        lr=settings["lr"],
        momentum=settings.get("momentum", 0.9),
        weight_decay=settings.get("weight_decay", 5e-4),
    )


def make_schedule(optimizer: torch.optim.Optimizer, settings: dict, steps: int):
    if settings.get("schedule", "cosine") == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))
    per_epoch = max(steps // max(settings["epochs"], 1), 1)
    milestones = [m * per_epoch for m in settings.get("milestones", [])]
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, settings.get("gamma", 0.1))


@dataclass
class Checkpointing:
    """Where a stage's checkpoint goes, what it must match, and whether to resume."""

    path: Path
    meta: dict
    resume: bool = False


def train(
    model: nn.Module,
    train_loader: DataLoader,
    test_loader: DataLoader,
    settings: dict,
    log: MetricsLog,
    stage: str,
    pruner: nn.Module | None = None,
    flops_target: float | None = None,
    checkpoint: Checkpointing | None = None,
    options: RunOptions | None = None,
    on_epoch: Callable[[int], None] | None = None,
) -> dict:
    """Train for settings["epochs"]; log loss and accuracy per epoch; return the summary.

    With `checkpoint`, the stage is saved after every epoch; with `checkpoint.resume` and
    a checkpoint present, it continues from there (a finished stage returns at once) and
    ends bitwise where an uninterrupted run ends.
    """
    epochs = settings["epochs"]
    options = options or RunOptions()
    if options.channels_last:
        model.to(memory_format=torch.channels_last)
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device) if options.amp == "fp16" else None
    optimizer = make_optimizer(model, settings, pruner)
    schedule = make_schedule(optimizer, settings, epochs * len(train_loader))
    if pruner is not None:
        if distributed.active():  # same scores on every rank: same masks and state
            optimizer.register_step_pre_hook(lambda *_: distributed.average_gradients(pruner))
        pruner.attach(optimizer)
    first_epoch, seconds = 0, 0.0
    if checkpoint is not None and checkpoint.resume and checkpoint.path.exists():
        saved = _restore(checkpoint, model, optimizer, schedule, pruner, train_loader, log)
        if scaler is not None and saved.get("scaler") is not None:
            scaler.load_state_dict(saved["scaler"])
        if saved["done"]:
            return saved["result"]
        first_epoch, seconds = saved["epoch"], saved["seconds"]
    start = time.perf_counter() - seconds
    model.train()
    bar = tqdm(total=epochs * len(train_loader), initial=first_epoch * len(train_loader),
               desc=stage, disable=not options.progress, leave=False)  # fmt: skip
    net = distributed.wrap(model)
    for epoch in range(first_epoch, epochs):
        if isinstance(train_loader.sampler, torch.utils.data.DistributedSampler):
            train_loader.sampler.set_epoch(epoch)
        total = torch.zeros(())  # summed on the device: no host sync per step
        for images, labels in train_loader:
            loss = training_step(
                net, optimizer, options.images(images), labels, pruner, flops_target,
                settings.get("penalty_weight", 10.0), options.amp_dtype, scaler,
            )  # fmt: skip
            bar.update()
            schedule.step()
            total = total.to(loss.device) + loss
        accuracy = evaluate(model, test_loader, options)
        log.write(stage=stage, epoch=epoch, loss=total.item() / len(train_loader),
                  accuracy=accuracy)  # fmt: skip
        if on_epoch is not None:
            on_epoch(epoch)
        done = epoch + 1 == epochs
        result = {"seconds": time.perf_counter() - start, "accuracy": accuracy}
        if checkpoint is not None and distributed.is_main():
            save_atomic(
                make_payload(
                    checkpoint.meta, epoch=epoch + 1, done=done, result=result,
                    seconds=result["seconds"], model=model.state_dict(),
                    optimizer=optimizer.state_dict(), scheduler=schedule.state_dict(),
                    pruner=pruner.state_dict() if pruner is not None else None,
                    rng=torch.get_rng_state(), loader_rng=_loader_rng(train_loader),
                    scaler=scaler.state_dict() if scaler is not None else None,
                    log_rows=log.rows,
                ),
                checkpoint.path,
            )  # fmt: skip
    bar.close()
    if first_epoch < epochs:  # the last epoch's evaluation: no second pass over the test set
        return result
    return {
        "seconds": time.perf_counter() - start,
        "accuracy": evaluate(model, test_loader, options),
    }


def _loader_rng(loader: DataLoader) -> torch.Tensor | None:
    """The shuffling generator's state (None under a DistributedSampler: seed + epoch)."""
    return loader.generator.get_state() if loader.generator is not None else None


def _restore(checkpoint: Checkpointing, model, optimizer, schedule, pruner, loader, log) -> dict:
    """Load a stage checkpoint into the run's objects, after checking all of it."""
    saved = load_checkpoint(checkpoint.path, checkpoint.meta)
    check_state_dict(model, saved["model"], "model", checkpoint.path)
    if pruner is not None:
        if saved["pruner"] is None:
            raise CheckpointError(f"{checkpoint.path} holds no pruner state")
        check_state_dict(pruner, saved["pruner"], "pruner state", checkpoint.path)
    model.load_state_dict(saved["model"])
    if pruner is not None:
        pruner.load_state_dict(saved["pruner"])
    optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    if loader.generator is not None and saved["loader_rng"] is not None:
        loader.generator.set_state(saved["loader_rng"])
    log.restore(saved["log_rows"])
    return saved
