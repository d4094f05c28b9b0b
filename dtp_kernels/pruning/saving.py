"""Saving and loading an exported (physically pruned) model.

The file holds the whole module (architecture and weights), so loading needs neither
the original model nor a re-run of the pruning; the classes it uses must be importable
(torch's usual rule for pickled modules). A format tag guards against other files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

FORMAT = "dtp-kernels/pruned-model"
VERSION = 1


def save_pruned(path: str | Path, model: nn.Module) -> None:
    """Write `model` (e.g. ``pruner.export()``) to `path`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    torch.save({"format": FORMAT, "version": VERSION, "model": model}, path)


def load_pruned(path: str | Path, map_location: str | torch.device | None = None) -> nn.Module:
    """Read a model written by :func:`save_pruned`."""
    # weights_only=False: the architecture is pickled too; load only files you trust.
    payload = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pruned model saved by dtp_kernels.save_pruned")
    if payload.get("version") != VERSION:
        raise ValueError(
            f"{path} has format version {payload.get('version')}; this dtp_kernels reads "
            f"version {VERSION}"
        )
    return payload["model"]
