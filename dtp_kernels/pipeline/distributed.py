"""Multi-process training (torchrun, DDP) for the pipeline.

Under torchrun (WORLD_SIZE > 1) the process group starts from the environment (NCCL on
GPUs, gloo on CPU), each rank reads its shard of the training set (DistributedSampler),
the model trains wrapped in DistributedDataParallel, and the pruner's own parameters
(scores, learned ratios) are averaged over the ranks before every optimizer step (by the
hook DTPPruner.attach registers when the process group has several ranks). Every
rank then computes the same masks and the same transport state from the same scores
with the same deterministic kernels; only rank 0 writes files.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_from_env(device: torch.device) -> int:
    """Start the process group when launched by torchrun (NCCL for a CUDA `device`, gloo
    on the CPU); returns this process's rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_id = device if backend == "nccl" else None
        store = _attempt_store()
        if store is None:
            dist.init_process_group(backend, device_id=device_id)
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(
                backend, device_id=device_id, store=store, rank=rank, world_size=world
            )
    return dist.get_rank() if dist.is_initialized() else 0


def _attempt_store() -> dist.Store | None:
    """After torchrun restarted its workers, the store its agent keeps across attempts
    still holds the failed attempt's connection keys, and gloo would wait for peers that
    are gone; the keys of each attempt get their own prefix. None: the default store."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    return dist.PrefixStore(f"dtp-kernels/attempt_{attempt}", agent)


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def end() -> None:
    """End the process group, when one runs, after every rank got here: a process that
    exits with it running leaves gloo's threads to abort the process at exit ("terminate
    called without an active exception") and NCCL to warn that it was not destroyed.
    Called by `dtp prune` once its run is over on every rank. run() leaves the group it
    started running, so that a script can call it again (a group started anew from
    torchrun's variables in the same process failed to connect its ranks)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (nothing when not distributed)."""
    if active():
        dist.barrier()


def wrap(model: nn.Module) -> nn.Module:
    """DistributedDataParallel around `model` when running distributed and some of its
    parameters train, else `model` (frozen weights have no gradients to average)."""
    if not active() or not any(p.requires_grad for p in model.parameters()):
        return model
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


class Agreement:
    """A value every rank agrees on (the max over the ranks), one call late: each call
    starts the max of this rank's value on a CPU gloo group (the GPUs are not synced)
    and returns the previous call's result (0 at the first), so the exchange overlaps a
    step instead of adding a round trip to it. Made and called in the same order on
    every rank (a collective)."""

    def __init__(self) -> None:
        group = dist.new_group(backend="gloo")
        assert isinstance(group, dist.ProcessGroup)  # every rank is in it
        self._group = group
        self._pending: tuple[torch.Tensor, dist.Work] | None = None

    def __call__(self, value: int) -> int:
        agreed = 0
        if self._pending is not None:
            previous, work = self._pending
            work.wait()  # started a step ago: done by now
            agreed = int(previous)
        mine = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        assert work is not None  # (async_op)
        self._pending = (mine, work)
        return agreed

    def close(self) -> None:
        """Finish the last exchange (every rank calls it at the same point)."""
        if self._pending is not None:
            self._pending[1].wait()
        self._pending = None
