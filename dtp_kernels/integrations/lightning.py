"""DTP in PyTorch Lightning: a Callback that prepares the pruner when fitting starts (the
Trainer has made the LightningModule's optimizers by then, and not yet loaded their
state from a checkpoint) and keeps its state in Lightning's checkpoints."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch import Callback

from ..pruning.example_inputs import on_model_device
from ..pruning.prepare import check_score_options, join_optimizer, unwrap_optimizer
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
    ``callback.pruner.export()`` is the smaller module. A checkpoint holds the module's
    weights under their own names (without the masks' parametrizations, so it loads
    into the module as it was built) and, as the callback's state, the pruner's scores
    and transport state: ``trainer.fit(module, ckpt_path=...)`` with a new callback of
    the same arguments resumes the run where it stopped (the scores' optimizer state
    too). A weights-only checkpoint (``save_weights_only=True``) holds the weights but
    not the pruner's state: it does not resume a DTP run.
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
        check_score_options(score_lr, 0.0, None, pruner_kwargs.get("scores"))
        self.example_inputs = example_inputs
        self.ratios = ratios
        self.optimizer_index = optimizer_index
        self.score_lr = score_lr
        self.pruner_kwargs = pruner_kwargs
        self.pruner: DTPPruner | None = None
        self._resumed: dict | None = None  # a checkpoint's pruner state, until the pruner

    def on_fit_start(self, trainer, pl_module) -> None:
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
        # what join_optimizer refuses, refused before the module gets its masks
        check_score_options(
            self.score_lr, 0.0, schedulers or None, self.pruner_kwargs.get("scores")
        )
        unwrap_optimizer(optimizer)
        pruner = DTPPruner(pl_module, inputs, self.ratios, **self.pruner_kwargs)
        if self._resumed is not None:  # before the Trainer loads the optimizer's state
            pruner.load_state_dict(self._resumed)
            self._resumed = None
        join_optimizer(pruner, optimizer, score_lr=self.score_lr, scheduler=schedulers or None)
        pruner.name_weights_unmasked()  # checkpoints hold the weights under their own names
        self.pruner = pruner

    def state_dict(self) -> dict:
        return {} if self.pruner is None else {"pruner": self.pruner.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        # called when a checkpoint is restored, before fitting starts: kept until then
        self._resumed = state_dict.get("pruner")
