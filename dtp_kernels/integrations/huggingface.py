"""DTP in Hugging Face's Trainer: a TrainerCallback that prepares the pruner when training
begins (the Trainer has made its optimizer by then) and saves its state beside every
checkpoint, so that ``trainer.train(resume_from_checkpoint=...)`` resumes a DTP run.

The Trainer loads a checkpoint's weights, optimizer and scheduler before any callback
event of the resumed run, so those files must load into the model and optimizer as they
are before the pruner: the model's files hold the weights under their own keys
(:meth:`DTPPruner.name_weights_unmasked`), the optimizer's file leaves out the scores'
group and the scheduler's entry for it loads into a scheduler without one
(prepare._extend_scheduler). The scores, transport state and the scores' group go to
``dtp_pruner.pt`` in the checkpoint's directory."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..pruning.config_forecast import config_forecast, forecast_message
from ..pruning.example_inputs import on_model_device
from ..pruning.prepare import check_score_options, join_optimizer, unwrap_optimizer
from ..pruning.pruner import DTPPruner, StepHooks
from ..pruning.ratios import Ratios
from ..pruning.zero_scores import ZeroScores, find_zero_optimizer

CHECKPOINT_FILE = "dtp_pruner.pt"


class DTPTrainerCallback(TrainerCallback):
    """Prune the Trainer's model with DTP while it trains.

    Args:
        example_inputs: a tensor, tuple or dict of keyword arguments the model runs on
            (e.g. a batch of input ids, or ``{"input_ids": ..., "attention_mask": ...}``);
            moved to the model's device.
        ratios: as for :class:`DTPPruner` (e.g. ``{"heads": 0.5, "mlp": 0.5}``).
        score_lr, pruner_kwargs: as for :func:`dtp_kernels.prepare`.
        resume_from: the checkpoint directory a resumed run reads the pruner's state from,
            where it is not ``output_dir/checkpoint-<step>`` (what
            ``resume_from_checkpoint=True`` picks).

    The scores follow the Trainer's learning-rate schedule. After ``trainer.train()``,
    ``callback.pruner.export()`` is the smaller model, with its config updated for
    ``save_pretrained``; where the config cannot describe the pruned sizes (GPT-2's
    fewer heads), training begins with a warning to save it with ``save_pruned``
    (:func:`dtp_kernels.pruning.config_forecast.config_forecast`).

    Checkpoints: every checkpoint directory gets ``dtp_pruner.pt`` (scores, transport
    state, the scores' optimizer state) and the model's files hold the weights without
    the masks, so ``trainer.train(resume_from_checkpoint=...)`` with a new model and a
    new callback of the same arguments continues the run as if it had not stopped. The
    model's files (``trainer.save_model()`` too) load into the model as it was built:
    the dense weights, not the pruned model, which is ``pruner.export()``. With
    ``load_best_model_at_end`` the pruner's state is the best checkpoint's, as the
    weights are. (``callback.scores_group.whole_state_dict()`` is the optimizer's state
    with the scores' group, which ``optimizer.state_dict()`` leaves out.)

    Under several processes (DDP) every rank computes the same masks: the scores'
    gradients are averaged over the ranks before every update (:meth:`DTPPruner.attach`).
    Under DeepSpeed, ZeRO stages 1 and 2 fix their optimizer's groups: the scores get an
    optimizer of their own, stepped after every ZeRO step (its state goes to
    ``dtp_pruner.pt``); ZeRO stage 3, which partitions the weights, is refused.
    The Trainer zeroes only the model's gradients; the callback drops the scores' after
    every step.
    """

    def __init__(
        self,
        example_inputs: torch.Tensor | tuple | Mapping,
        ratios: Ratios,
        *,
        score_lr: float | None = None,
        resume_from: str | os.PathLike | None = None,
        **pruner_kwargs,
    ) -> None:
        check_score_options(score_lr, 0.0, None, pruner_kwargs.get("scores"))
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(
                f"resume_from must be a checkpoint directory, got {type(resume_from).__name__}"
            )
        self.example_inputs = example_inputs
        self.ratios = ratios
        self.score_lr = score_lr
        self.resume_from = resume_from
        self.pruner_kwargs = pruner_kwargs
        self.pruner: DTPPruner | None = None
        self.scores_group: ScoresGroup | None = None  # None: no learned scores
        self._step_hooks: StepHooks | ZeroScores | None = None
        # the optimizer the scores are in (or beside: DeepSpeed's ZeRO, zero_scores.py)
        self._optimizer: object | None = None

    def on_train_begin(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs
    ):
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to on_train_begin")
        if self.pruner is not None:
            if model is not self.pruner.model:
                raise RuntimeError("DTPTrainerCallback prunes one model; make a new one")
            self._join_again(self.pruner, optimizer, lr_scheduler)
            if state.global_step != 0:  # the Trainer loaded the checkpoint's optimizer again
                saved = self._resumed_state(args, state)
                _restore(self.pruner, saved, isinstance(self._step_hooks, ZeroScores))
                self._load_scores_optimizer(saved)
            return control
        # what join_optimizer refuses, refused before the model gets its masks
        check_score_options(self.score_lr, 0.0, lr_scheduler, self.pruner_kwargs.get("scores"))
        inner = _scores_optimizer_home(optimizer)
        resumed = self._resumed_state(args, state)
        inputs = on_model_device(self.example_inputs, model)
        pruner = DTPPruner(model, inputs, self.ratios, **self.pruner_kwargs)
        if resumed is not None:
            try:
                _restore(pruner, resumed, not isinstance(inner, torch.optim.Optimizer))
            except (RuntimeError, ValueError) as error:
                pruner.remove()  # the model as it was
                raise ValueError(
                    f"the checkpoint's pruner state ({CHECKPOINT_FILE}) does not fit this "
                    f"callback's pruner: was it saved with other ratios or options? {error}"
                ) from error
        self._step_hooks = join_optimizer(
            pruner, inner, score_lr=self.score_lr, scheduler=lr_scheduler
        )
        pruner.name_weights_unmasked()
        self.pruner, self._optimizer = pruner, inner
        if list(pruner.parameters()) and not isinstance(self._step_hooks, ZeroScores):
            self.scores_group = ScoresGroup(pruner, inner)
        if resumed is not None:
            self._load_scores_optimizer(resumed)
        forecast = config_forecast(pruner)
        if forecast is not None and not forecast["describes"]:  # now, not after training
            learned = pruner.budget != "layer"
            warnings.warn(forecast_message(forecast, learned), UserWarning, stacklevel=2)
        return control

    def _join_again(self, pruner: DTPPruner, optimizer, lr_scheduler) -> None:
        """The Trainer starts over with a smaller batch (``auto_find_batch_size`` after an
        out-of-memory error): the pruner, masks and scores stay, as the model's weights
        do (a resumed run's pruner goes back to the checkpoint's state, as the optimizer
        does: on_train_begin). The Trainer keeps its optimizer, scores' group and hooks
        included, and makes its new scheduler over every group; an optimizer made anew (a
        Trainer subclass may) gets the scores' group and the hooks, which leave the old
        one."""
        inner = _scores_optimizer_home(optimizer)
        if inner is self._optimizer:
            return
        if isinstance(self._step_hooks, ZeroScores) and find_zero_optimizer(optimizer) is None:
            raise RuntimeError(
                "the same Trainer trains again under DeepSpeed: transformers keeps the first "
                "run's engine and makes this run's optimizer outside it (accelerate's backward "
                "then fails). Make a new Trainer and DTPTrainerCallback and pass "
                "resume_from_checkpoint to train()"
            )
        check_score_options(self.score_lr, 0.0, lr_scheduler, self.pruner_kwargs.get("scores"))
        if self._step_hooks is not None:
            self._step_hooks.remove()
        if self.scores_group is not None:
            self.scores_group.remove()
        self._step_hooks = join_optimizer(
            pruner, inner, score_lr=self.score_lr, scheduler=lr_scheduler
        )
        if self.scores_group is not None:
            self.scores_group = ScoresGroup(pruner, inner)
        self._optimizer = inner

    def _load_scores_optimizer(self, saved: dict) -> None:
        """The scores' optimizer state from the checkpoint's pruner file: their group of
        the Trainer's optimizer, or their own optimizer beside DeepSpeed's ZeRO."""
        if self.scores_group is not None:
            self.scores_group.load(saved["scores_group"])
        elif isinstance(self._step_hooks, ZeroScores) and self._step_hooks.optimizer:
            self._step_hooks.optimizer.load_state_dict(saved["scores_optimizer"])

    def on_step_end(self, args, state, control, **kwargs):
        # the Trainer zeroes the model's gradients (model.zero_grad()), and the scores are
        # the pruner's: without this they would add up over every step
        if self.pruner is not None:
            for parameter in self.pruner.parameters():
                parameter.grad = None
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.pruner is None or not args.should_save:
            return control
        directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(directory):
            raise RuntimeError(
                f"DTPTrainerCallback: the Trainer saved a checkpoint, but not in {directory}, "
                "where the pruner's state goes (a hyperparameter search's runs are not supported)"
            )
        saved = {
            "step": state.global_step,
            "pruner": self.pruner.state_dict(),
            "scores_group": None if self.scores_group is None else self.scores_group.saved(),
            "scores_optimizer": _zero_scores_state(self._step_hooks),
        }
        torch.save(saved, os.path.join(directory, CHECKPOINT_FILE))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        best = state.best_model_checkpoint
        if self.pruner is not None and args.load_best_model_at_end and best is not None:
            # the Trainer loaded the best checkpoint's weights: its masks go with them
            path = os.path.join(best, CHECKPOINT_FILE)
            self.pruner.load_state_dict(_load(path)["pruner"])
        return control

    def _resumed_state(self, args, state) -> dict | None:
        """The saved state of the checkpoint the Trainer resumes from (None at step 0)."""
        if state.global_step == 0:
            if self.resume_from is not None:
                raise ValueError(
                    f"resume_from = {os.fspath(self.resume_from)!r}, but the Trainer starts at "
                    "step 0: pass the checkpoint to trainer.train(resume_from_checkpoint=...)"
                )
            return None
        directory = self.resume_from or os.path.join(
            args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        path = os.path.join(directory, CHECKPOINT_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"the Trainer resumes at step {state.global_step}, but {path} (the pruner's "
                "state, which DTPTrainerCallback writes into every checkpoint) does not exist: "
                "give DTPTrainerCallback(resume_from=<the checkpoint's directory>) where it "
                "lies elsewhere; a checkpoint of training without DTP is no DTP run to resume "
                "(load its weights into the model and train from step 0)"
            )
        saved = _load(path)
        if saved.get("step") != state.global_step:
            raise ValueError(
                f"{path} holds the pruner at step {saved.get('step')}; the Trainer resumes "
                f"at step {state.global_step}"
            )
        return saved


class ScoresGroup:
    """The scores' parameter group of the Trainer's optimizer, kept out of the file the
    Trainer writes of it (a resumed run's optimizer lacks the group when the Trainer
    loads that file) and saved and restored by the callback instead.

    ``optimizer.state_dict()`` leaves the group out, and ``optimizer.load_state_dict``
    of a state without it keeps the group as it is (the Trainer loads the file again
    into the optimizer holding the group when ``auto_find_batch_size`` starts a resumed
    run over)."""

    def __init__(self, pruner: DTPPruner, optimizer: torch.optim.Optimizer) -> None:
        self.pruner, self.optimizer = pruner, optimizer
        self._whole = False  # state_dict() with the group, for the callback's own use
        self._hooks = [
            optimizer.register_state_dict_post_hook(self._without),
            optimizer.register_load_state_dict_pre_hook(self._with),
        ]

    def remove(self) -> None:
        """Leave the optimizer's state_dict and load_state_dict as they were."""
        for hook in self._hooks:
            hook.remove()

    def index(self) -> int:
        own = {id(p) for p in self.pruner.parameters()}
        for index, group in enumerate(self.optimizer.param_groups):
            if any(id(p) in own for p in group["params"]):
                return index
        raise RuntimeError("the pruner's scores are in no group of the Trainer's optimizer")

    def whole_state_dict(self) -> dict:
        """The optimizer's state_dict with the scores' group."""
        self._whole = True
        try:
            return self.optimizer.state_dict()
        finally:
            self._whole = False

    def saved(self) -> dict:
        whole = self.whole_state_dict()
        group = whole["param_groups"][self.index()]
        return {
            "group": {key: value for key, value in group.items() if key != "params"},
            "state": [whole["state"].get(key) for key in group["params"]],
        }

    def load(self, saved: dict) -> None:
        whole, index = self.whole_state_dict(), self.index()
        group = whole["param_groups"][index]
        for key, value in zip(group["params"], saved["state"], strict=True):
            if value is not None:
                whole["state"][key] = value
        whole["param_groups"][index] = {**saved["group"], "params": group["params"]}
        self.optimizer.load_state_dict(whole)

    def _without(self, optimizer, state_dict: dict) -> dict | None:
        if self._whole:
            return None
        index = self.index()
        ids = set(state_dict["param_groups"][index]["params"])
        return {
            **state_dict,
            "state": {key: value for key, value in state_dict["state"].items() if key not in ids},
            "param_groups": [g for i, g in enumerate(state_dict["param_groups"]) if i != index],
        }

    def _with(self, optimizer, state_dict: dict) -> dict | None:
        if len(state_dict["param_groups"]) != len(optimizer.param_groups) - 1:
            return None  # the whole state, or one load_state_dict refuses as it is
        whole, index = self.whole_state_dict(), self.index()
        group = whole["param_groups"][index]
        # the group's parameters under keys the loaded state does not use
        first = 1 + max((k for g in state_dict["param_groups"] for k in g["params"]), default=-1)
        keys = range(first, first + len(group["params"]))
        state = dict(state_dict["state"])
        state.update(
            {
                new: whole["state"][old]
                for new, old in zip(keys, group["params"], strict=True)
                if old in whole["state"]
            }
        )
        groups = list(state_dict["param_groups"])
        groups.insert(index, {**group, "params": list(keys)})
        return {**state_dict, "state": state, "param_groups": groups}


def _scores_optimizer_home(optimizer):
    """Where the scores' optimizer state lives: DeepSpeed's ZeRO optimizer (the scores
    get one of their own beside it) or the torch optimizer inside `optimizer`; what
    neither can take is refused before the model gets its masks."""
    zero = find_zero_optimizer(optimizer)
    return zero if zero is not None else unwrap_optimizer(optimizer)


def _zero_scores_state(hooks) -> dict | None:
    if isinstance(hooks, ZeroScores) and hooks.optimizer is not None:
        return hooks.optimizer.state_dict()
    return None


def _restore(pruner: DTPPruner, saved: dict, beside_zero: bool) -> None:
    """Load the saved scores and transport state; check the saved optimizer state has one
    entry per parameter of the pruner, of the kind this run keeps (a group of the
    Trainer's optimizer, or an optimizer beside DeepSpeed's ZeRO)."""
    own = saved.get("scores_optimizer")
    if (own is not None) != beside_zero and list(pruner.parameters()):
        was, now = ("beside", "in") if own is not None else ("in", "beside")
        raise ValueError(
            f"its scores were trained {was} DeepSpeed's ZeRO optimizer; this run trains them "
            f"{now} it (a ZeRO stage 1 or 2 config in one run and not in the other)"
        )
    pruner.load_state_dict(saved["pruner"])
    if own is not None:
        entries = [p for g in own["param_groups"] for p in g["params"]]
    else:
        entries = saved["scores_group"]["state"] if saved["scores_group"] is not None else []
    parameters = len(list(pruner.parameters()))
    if len(entries) != parameters:
        raise ValueError(
            f"its optimizer state holds {len(entries)} parameters; this pruner has {parameters}"
        )


def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
