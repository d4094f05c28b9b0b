"""Stopping a run cleanly when the cluster asks: SIGTERM, SIGINT and SIGUSR1 (what
schedulers such as Slurm send before they stop a job) are caught, the current training
step finishes, a checkpoint is written and the run ends with `Preempted`, which the
command line turns into a message saying how to resume and exit code 128 + signal."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist

from .distributed import Agreement

SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name)
)


class Preempted(Exception):  # noqa: N818 (a stop, not a fault)
    """The run stopped at a signal after writing a checkpoint; `--resume` continues it."""

    def __init__(self, signum: int, stage: str, epoch: int, step: int, checkpoint) -> None:
        self.signum, self.stage, self.epoch, self.step = signum, stage, epoch, step
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
        super().__init__(
            f"stopped by {name} in stage {stage}, epoch {epoch}, after step {step}; {where} written"
        )


class PreemptionGuard:
    """While active, the signals above set a flag instead of killing the process.

    `requested()` is read after every training step; under torch.distributed every rank
    agrees on it: each step starts a max over the ranks of the flag on a CPU gloo group
    (the GPUs are not synced) and the next step reads it, so the exchange overlaps a
    step instead of adding a round trip to it and all ranks stop after the same step,
    one after the one that saw the signal. Outside the main thread (where Python cannot
    install signal handlers) the guard does nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._agreement: Agreement | None = None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._agreement = Agreement()
        return self

    def __exit__(self, exc_type, *_) -> None:
        # Every rank finishes the last exchange on a normal end or a preemption (all ranks
        # are there); after another error the other ranks may never join it.
        if self._agreement is not None and (exc_type is None or issubclass(exc_type, Preempted)):
            self._agreement.close()
        self._agreement = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signum = signum

    def requested(self) -> int | None:
        """The signal to stop at (None: keep going), the same on every rank."""
        if self._agreement is None:
            return self.signum
        return self._agreement(self.signum or 0) or None
