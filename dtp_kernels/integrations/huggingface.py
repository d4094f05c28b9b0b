"""DTP in Hugging Face's Trainer: a TrainerCallback that prepares the pruner when training
begins (the Trainer has made its optimizer by then)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from transformers import TrainerCallback

from ..pruning.config_forecast import config_forecast, forecast_message
from ..pruning.example_inputs import on_model_device
from ..pruning.prepare import prepare
from ..pruning.pruner import DTPPruner
from ..pruning.ratios import Ratios


class DTPTrainerCallback(TrainerCallback):
    """Prune the Trainer's model with DTP while it trains.

    Args:
        example_inputs: a tensor, tuple or dict of keyword arguments the model runs on
            (e.g. a batch of input ids, or ``{"input_ids": ..., "attention_mask": ...}``);
            moved to the model's device.
        ratios: as for :class:`DTPPruner` (e.g. ``{"heads": 0.5, "mlp": 0.5}``).
        score_lr, pruner_kwargs: as for :func:`dtp_kernels.prepare`.

    The scores follow the Trainer's learning-rate schedule. After ``trainer.train()``,
    ``callback.pruner.export()`` is the smaller model, with its
    config updated for ``save_pretrained``; where the config cannot describe the pruned
    sizes (GPT-2's fewer heads), training begins with a warning to save it with
    ``save_pruned`` (:func:`dtp_kernels.pruning.config_forecast.config_forecast`). The
    scores and transport state are not in the Trainer's checkpoints: a run is trained
    from its start.
    """

    def __init__(
        self,
        example_inputs: torch.Tensor | tuple | Mapping,
        ratios: Ratios,
        *,
        score_lr: float | None = None,
        **pruner_kwargs,
    ) -> None:
        self.example_inputs = example_inputs
        self.ratios = ratios
        self.score_lr = score_lr
        self.pruner_kwargs = pruner_kwargs
        self.pruner: DTPPruner | None = None

    def on_train_begin(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs
    ):
        if self.pruner is not None:
            raise RuntimeError("DTPTrainerCallback prunes one training run; make a new one")
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to on_train_begin")
        inputs = on_model_device(self.example_inputs, model)
        self.pruner = prepare(
            model,
            optimizer,
            inputs,
            self.ratios,
            score_lr=self.score_lr,
            scheduler=lr_scheduler,
            **self.pruner_kwargs,
        )
        forecast = config_forecast(self.pruner)
        if forecast is not None and not forecast["describes"]:  # now, not after training
            learned = self.pruner.budget != "layer"
            warnings.warn(forecast_message(forecast, learned), UserWarning, stacklevel=2)
        return control
