"""The scores trained beside DeepSpeed's ZeRO optimizer (stages 1, 2 and 3).

ZeRO flattens and partitions its parameter groups when it is made, and its step walks
those groups: a group added later breaks it. The scores get an optimizer of their own,
of the update and settings of the one ZeRO steps, stepped right after every ZeRO step that
updates the weights (a step skipped for an overflow skips the scores too), at the score
learning rate scaled as the first group's is (the schedule), with the loss scale taken
out of their gradients. Stage 3 partitions the weights themselves, which the masks
multiply whole: it trains a pruner made before ``deepspeed.initialize`` (whose masks
then live in parametrizations of the layers, gathered with the weights), joined with
join_optimizer; prepare() and the Trainer's callback, which make the pruner after it,
refuse it."""

from __future__ import annotations

import inspect

import torch

from .pruner import DTPPruner, distributed

STAGE_3 = "DeepSpeedZeroOptimizer_Stage3"
WRAPPED = ("step", "state_dict", "load_state_dict")  # ZeRO's methods ZeroScores extends
CHECKPOINT_KEY = "dtp_scores_optimizer"  # the scores' optimizer state in ZeRO's
# DeepSpeed's own Adams (a config's "Adam"/"AdamW" block; CPUAdam under offload_optimizer):
# torch's Adam or AdamW makes the same update, and the scores are few (no fused kernel needed)
DEEPSPEED_ADAMS = ("FusedAdam", "DeepSpeedCPUAdam")


def scores_optimizer_class(inner: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The torch optimizer that steps the scores beside ZeRO's optimizer `inner`: its own
    class when it is torch's, torch's Adam or AdamW for DeepSpeed's FusedAdam and
    DeepSpeedCPUAdam (by their ``adam_w_mode``). Any other is refused, naming it."""
    kind = type(inner)
    if kind.__module__.startswith("torch.optim"):
        return kind
    if kind.__module__.startswith("deepspeed.ops.adam") and kind.__name__ in DEEPSPEED_ADAMS:
        if not all(group.get("bias_correction", True) for group in inner.param_groups):
            raise ValueError(
                f"DeepSpeed's {kind.__name__} runs with bias_correction=False, which torch's "
                "Adam, stepping the scores beside it, does not offer: leave bias_correction on"
            )
        adam_w = inner.adam_w_mode  # type: ignore[attr-defined]  # DeepSpeed's Adams have it
        return torch.optim.AdamW if adam_w else torch.optim.Adam
    raise ValueError(
        f"DeepSpeed's ZeRO optimizer steps {kind.__name__} ({kind.__module__}): the scores "
        "beside it are stepped by a torch optimizer of the same update, known for torch.optim's "
        f"optimizers and DeepSpeed's {' and '.join(DEEPSPEED_ADAMS)} (a config's \"Adam\" or "
        '"AdamW", offloaded or not): use one of those'
    )


def find_zero_optimizer(optimizer, stage_3: bool = False) -> object | None:
    """DeepSpeed's ZeRO optimizer among `optimizer` and the wrappers around it
    (Accelerate's keeps it in ``.optimizer``); None where there is none. Refused: ZeRO
    stage 3 unless `stage_3` (a pruner made before its weights were partitioned) and a
    ZeRO optimizer stepping an optimizer whose update no torch optimizer makes for the
    scores (scores_optimizer_class)."""
    inner = optimizer
    # (Accelerate's wrapper is a torch Optimizer too: walk to torch's own)
    while inner is not None and not type(inner).__module__.startswith("torch.optim"):
        if type(inner).__module__.startswith("deepspeed.runtime.zero"):
            if type(inner).__name__ == STAGE_3 and not stage_3:
                raise ValueError(
                    f"optimizer is DeepSpeed's ZeRO stage 3 optimizer ({STAGE_3}), which "
                    "partitions the weights: DTP's masks multiply whole weights. In a loop of "
                    "your own, make the pruner before deepspeed.initialize and join it with "
                    "join_optimizer (docs/pruning.md); or train with ZeRO stage 0, 1 or 2"
                )
            scores_optimizer_class(inner.optimizer)  # refused: before any mask
            return inner
        inner = getattr(inner, "optimizer", None)
    return None


class ZeroScores:
    """The pruner's scores stepped after every step of DeepSpeed's ZeRO optimizer `zero`
    (stages 1, 2 and 3), by a torch optimizer of the update and settings of the one ZeRO
    steps (scores_optimizer_class).
    ZeRO's state_dict holds that optimizer's state too, and its load_state_dict takes
    it, so ``engine.save_checkpoint`` / ``engine.load_checkpoint`` keep it (the
    pruner's own state, ``pruner.state_dict()``, goes in as client state).
    ``remove()`` gives `zero` its own methods back."""

    def __init__(
        self,
        pruner: DTPPruner,
        zero,
        *,
        score_lr: float | None = None,
        score_weight_decay: float = 0.0,
    ) -> None:
        kind = scores_optimizer_class(zero.optimizer)
        self.pruner, self.zero = pruner, zero
        first = zero.param_groups[0]
        self._first_lr = first.get("initial_lr", first["lr"])  # its schedule's 1.0
        self.lr = float(score_lr) if score_lr is not None else self._first_lr
        params = list(pruner.parameters())  # scores, learned ratios; none: magnitude scores
        self.optimizer: torch.optim.Optimizer | None = None  # None: magnitude scores
        if params:
            accepted = inspect.signature(kind).parameters
            settings = {k: v for k, v in first.items() if k in accepted and k != "params"}
            settings.update(lr=self.lr, weight_decay=score_weight_decay)
            self.optimizer = kind(params, **settings)
        # attributes of the instance, which remove() deletes: the scores' optimizer state
        # goes into ZeRO's checkpoints (engine.save_checkpoint, load_checkpoint) with its own
        self._zero = {name: getattr(zero, name) for name in WRAPPED}
        zero.step, zero.state_dict = self._step, self._state_dict
        zero.load_state_dict = self._load_state_dict

    def remove(self) -> None:
        for name in WRAPPED:
            if name in self.zero.__dict__:
                delattr(self.zero, name)

    def _state_dict(self) -> dict:
        state = self._zero["state_dict"]()
        if self.optimizer is not None:
            state[CHECKPOINT_KEY] = self.optimizer.state_dict()
        return state

    def _load_state_dict(self, state_dict_list, *args, **kwargs):
        """ZeRO's load_state_dict (a list of every rank's saved state; stage 3 reads its
        own rank's alone, None in the others' places) and the scores' optimizer state
        saved with it, which every rank holds alike."""
        # read first: ZeRO's own may empty the list as it goes (load_serial)
        saved = [s[CHECKPOINT_KEY] for s in state_dict_list or [] if s and CHECKPOINT_KEY in s]
        result = self._zero["load_state_dict"](state_dict_list, *args, **kwargs)
        states = kwargs.get("load_optimizer_states", args[0] if args else True)
        if states and saved and self.optimizer is not None:
            self.optimizer.load_state_dict(saved[0])
        return result

    def _step(self, *args, **kwargs):
        scale = float(getattr(self.zero, "loss_scale", 1.0))  # before the step updates it
        result = self._zero["step"](*args, **kwargs)
        if getattr(self.zero, "overflow", False):  # skipped: the scores skip it too
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            return result
        if self.optimizer is not None:
            if distributed():
                self.pruner._average_over_ranks()
            if scale != 1.0:  # fp16: the loss was scaled for the backward
                for parameter in self.pruner.parameters():
                    if parameter.grad is not None:
                        parameter.grad.div_(scale)
            first = self.zero.param_groups[0]
            base = first.get("initial_lr", self._first_lr)
            ratio = first["lr"] / base if base else 1.0
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr * ratio
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.pruner._after_update()
        return result
