"""Training checkpoints: written atomically, read with ``torch.load(weights_only=True)``,
checked against the run before anything is restored.

A checkpoint holds one training stage's model, optimizer, scheduler and (for the DTP
stage) pruner state with its transport state, the global CPU (and CUDA) RNG states, the
metrics so far and where to go on: the epoch and the step within it (a checkpoint written
at a preemption signal stops mid-epoch), with the loss summed over that epoch so far.
The data order needs no state: it is a function of the seed and the epoch.

A checkpoint is written to a temporary file in the same directory, flushed and
fsynced, then renamed over the old one, so a kill at any moment leaves
either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .errors import RunError, UsageError

FORMAT = "dtp-kernels/checkpoint"
VERSION = 3  # 2: mid-epoch steps, data order from (seed, epoch); 3: per-stage recipe fields


class CheckpointError(UsageError):
    """A checkpoint that does not belong to this run, or cannot be read."""


def save_atomic(payload: dict, path: str | Path) -> None:
    """torch.save to `path` so that a crash never leaves a partial file at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as error:  # a full disk, a quota, an I/O error
        tmp.unlink(missing_ok=True)
        kept = "the previous checkpoint there is kept" if path.exists() else "none was written"
        raise RunError(f"could not write the checkpoint {path} ({error}); {kept}") from error
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def make_payload(meta: dict, **fields) -> dict:
    return {"format": FORMAT, "version": VERSION, "meta": dict(meta), **fields}


def load_checkpoint(path: str | Path, meta: dict) -> dict:
    """Read a checkpoint and check that it was written by a run with the same `meta` (the
    recipe fields its stage depends on, run.stage_fields). Raises CheckpointError naming
    the first field that differs, with both values."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: not a readable checkpoint ({error})") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dtp-kernels training checkpoint")
    version = payload.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}; this dtp-kernels reads "
            f"versions up to {VERSION}: upgrade dtp-kernels to resume from it"
        )
    if version < VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version}, written by an older "
            f"dtp-kernels that ordered the data differently; this one resumes version "
            f"{VERSION}: start the run again in a new output directory"
        )
    saved = payload.get("meta", {})
    for key in sorted(set(meta) | set(saved)):
        if saved.get(key) != meta.get(key):
            raise CheckpointError(
                f"{path} was written for {key} = {saved.get(key)!r}, but this run has "
                f"{key} = {meta.get(key)!r}; resume with the recipe that wrote it, or start "
                "again with --overwrite (or in a new output directory)"
            )
    return payload


def check_state_dict(module: nn.Module, state: dict, what: str, path: str | Path) -> None:
    """Raise CheckpointError unless `state` has exactly `module`'s keys and shapes, so a
    load_state_dict that follows cannot stop half-way."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: saved {tuple(state[k].shape)}, here {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:
        details = "; ".join(
            part
            for part in (
                f"missing {missing[:3]}" if missing else "",
                f"unexpected {unexpected[:3]}" if unexpected else "",
                f"shape mismatch {shapes[:3]}" if shapes else "",
            )
            if part
        )
        raise CheckpointError(
            f"{path}: the saved {what} does not match this run's ({details}): it comes from "
            "another architecture or pruning ratio"
        )
