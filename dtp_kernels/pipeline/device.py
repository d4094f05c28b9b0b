"""Which device a run trains on, from `run.device`: auto | cpu | cuda | cuda:N."""

from __future__ import annotations

import os
import re

import torch

from .errors import UsageError

ALLOWED = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str) -> torch.device:
    """The run's device. `auto` is CUDA when a GPU is visible, else the CPU. Under torchrun
    (WORLD_SIZE > 1) `auto` and `cuda` give each rank cuda:LOCAL_RANK."""
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise UsageError(f"run.device = {name!r}; allowed: {ALLOWED}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(
            f"run.device = {name!r}, but no CUDA device is available here; "
            "use run.device=cpu (or auto)"
        )
    if name in ("auto", "cuda"):
        index = int(os.environ.get("LOCAL_RANK", "0"))
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            index = torch.cuda.current_device()
    else:
        index = int(name.split(":")[1])
    if index >= torch.cuda.device_count():
        raise UsageError(
            f"run.device = {name!r} needs GPU {index}, but only "
            f"{torch.cuda.device_count()} are visible"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
