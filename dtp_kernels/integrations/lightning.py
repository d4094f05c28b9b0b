"""DTP in PyTorch Lightning: a Callback that prepares the pruner when training starts (the
Trainer has made the LightningModule's optimizers by then)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch import Callback

from ..pruning.example_inputs import on_model_device
from ..pruning.prepare import prepare
from ..pruning.pruner import DTPPruner
from ..pruning.ratios import Ratios


class DTPCallback(Callback):
    """Prune the LightningModule with DTP while it trains.

    Args:
        example_inputs: a tensor, tuple or dict of keyword arguments the module's
            forward runs on; moved to its device.
        ratios: as for :class:`DTPPruner`.
        optimizer_index: which of the module's optimizers takes the scores.
        score_lr, pruner_kwargs: as for :func:`dtp_kernels.prepare`.

    The scores follow the optimizer's learning-rate schedule. After ``trainer.fit()``,
    ``callback.pruner.export()`` is the smaller module. The scores
    and transport state are not in Lightning's checkpoints: a run is trained from its start.
    """

    def __init__(
        self,
        example_inputs: torch.Tensor | tuple | Mapping,
        ratios: Ratios,
        *,
        optimizer_index: int = 0,
        score_lr: float | None = None,
        **pruner_kwargs,
    ) -> None:
        self.example_inputs = example_inputs
        self.ratios = ratios
        self.optimizer_index = optimizer_index
        self.score_lr = score_lr
        self.pruner_kwargs = pruner_kwargs
        self.pruner: DTPPruner | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if self.pruner is not None:
            raise RuntimeError("DTPCallback prunes one training run; make a new one")
        optimizers = trainer.optimizers
        if not 0 <= self.optimizer_index < len(optimizers):
            raise ValueError(
                f"optimizer_index = {self.optimizer_index}; the module has {len(optimizers)} "
                f"optimizers (allowed: 0 to {len(optimizers) - 1})"
            )
        inputs = on_model_device(self.example_inputs, pl_module)
        optimizer = optimizers[self.optimizer_index]
        schedulers = [
            config.scheduler
            for config in trainer.lr_scheduler_configs
            if config.scheduler.optimizer is optimizer
        ]
        self.pruner = prepare(
            pl_module,
            optimizer,
            inputs,
            self.ratios,
            score_lr=self.score_lr,
            scheduler=schedulers or None,
            **self.pruner_kwargs,
        )
