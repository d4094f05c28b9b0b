"""The run's output directory: never overwritten by accident, written by one run at a time.

A run into a directory that already holds a run's files is refused unless it resumes
that run (`--resume`) or replaces it (`--overwrite`, which deletes the files a run writes
and nothing else). While a run is going, its directory holds a lock file naming the
process; a second run into the same directory is refused, and the lock of a process
that no longer runs (killed, or its machine restarted) is named and taken over.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from .errors import UsageError

# What a run writes into its directory (see run.run).
OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "summary.json",
    "pruned.pt",
    "pruned",  # a Hugging Face model's save_pretrained directory
    "tokenizer",  # beside pruned.pt: a Hugging Face model's config cannot describe it
    "plots",
    "tensorboard",
)
LOCK = ".dtp-run.lock"


def has_checkpoints(out: Path) -> bool:
    return any((out / "checkpoints").glob("*.pt"))


def check(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, before anything is written, a run that would destroy another's files or
    resume nothing. Reads only, so every rank of a distributed run may call it."""
    if resume and overwrite:
        raise UsageError(
            "--resume and --overwrite exclude each other: continue the run or replace it"
        )
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if resume:
        if not has_checkpoints(out):
            raise UsageError(
                f"--resume: {out} holds no checkpoint to resume from "
                f"({out / 'checkpoints'} has no *.pt); start the run without --resume"
            )
        return
    present = sorted(p.name for p in out.iterdir() if p.name != LOCK) if out.is_dir() else []
    written = [name for name in present if name in OUTPUTS]
    if written and not overwrite:
        raise UsageError(
            f"--out {out} already holds a run ({', '.join(written)}); give --resume to "
            "continue it, --overwrite to replace it, or another --out"
        )


def clear(out: Path) -> list[str]:
    """Delete the files and folders a run writes (only those); returns their names."""
    removed = []
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """Holds `out`/.dtp-run.lock for the life of a run (a context manager)."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK
        self.held = False

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self.held = True
            return self

    def _take_over_if_stale(self) -> None:
        try:
            owner = json.loads(self.path.read_text())
            pid, host = int(owner["pid"]), str(owner["host"])
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (ValueError, KeyError, TypeError):
            raise UsageError(
                f"{self.path} exists but does not name a run; if no run is writing to "
                f"{self.path.parent}, delete it"
            ) from None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
        if host != socket.gethostname():
            raise UsageError(
                f"{self.path.parent} is in use by a run on host {host} (pid {pid}, since "
                f"{since}); if that run is gone, delete {self.path}"
            )
        if _running(pid) and pid != os.getpid():
            raise UsageError(
                f"{self.path.parent} is in use by another run (pid {pid}, since {since}); "
                "wait for it to end or choose another --out"
            )
        print(
            f"dtp prune: taking over the stale lock {self.path} of pid {pid} (started "
            f"{since}), which no longer runs",
            file=sys.stderr,
        )
        self.path.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
