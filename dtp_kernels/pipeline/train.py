"""Training stages: SGD with momentum and weight decay, cosine or step schedules, the DTP
pruner's scores in their own parameter group, metrics as JSONL lines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from .step import training_step


class MetricsLog:
    """Appends one JSON object per line to `path` (or keeps them in memory only)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path, self.rows = path, []

    def write(self, **row) -> None:
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    """Top-1 accuracy in [0, 1]."""
    was_training = model.training
    model.eval()
    correct = total = 0
    for images, labels in loader:
        correct += int((model(images).argmax(1) == labels).sum())
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


def train(
    model: nn.Module,
    train_loader: DataLoader,
    test_loader: DataLoader,
    settings: dict,
    log: MetricsLog,
    stage: str,
    pruner: nn.Module | None = None,
    flops_target: float | None = None,
) -> dict:
    """Train for settings["epochs"]; log loss and accuracy per epoch; return the summary."""
    epochs = settings["epochs"]
    optimizer = make_optimizer(model, settings, pruner)
    schedule = make_schedule(optimizer, settings, epochs * len(train_loader))
    if pruner is not None:
        pruner.attach(optimizer)
    start = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        total = torch.zeros(())  # summed on the device: no host sync per step
        for images, labels in train_loader:
            loss = training_step(
                model, optimizer, images, labels, pruner, flops_target,
                settings.get("penalty_weight", 10.0),
            )  # fmt: skip
            schedule.step()
            total = total.to(loss.device) + loss
        log.write(stage=stage, epoch=epoch, loss=total.item() / len(train_loader),
                  accuracy=evaluate(model, test_loader))  # fmt: skip
    return {"seconds": time.perf_counter() - start, "accuracy": evaluate(model, test_loader)}
