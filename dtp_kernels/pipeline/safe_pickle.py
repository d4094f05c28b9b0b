"""Reading pickle files the user's data directory holds (CIFAR's python batches) without
letting a crafted file run code: only the types those files are made of are built."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from .errors import UsageError

# What NumPy arrays and Python 2 byte strings unpickle through; nothing that executes.
ALLOWED_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
}


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"it refers to {module}.{name}, which a data file has no use for "
                f"(allowed: dicts, lists, numbers, strings, bytes and NumPy arrays)"
            )
        return super().find_class(module, name)


def load_data_pickle(path: str | Path, encoding: str = "latin1") -> Any:
    """Unpickle `path` allowing only plain containers, numbers, strings, bytes and NumPy
    arrays. A file that asks for anything else (a function to call, a class to build) is
    refused with a UsageError naming it, before anything of it runs."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return _DataUnpickler(io.BytesIO(data), encoding=encoding).load()
    except pickle.UnpicklingError as error:
        raise UsageError(f"{path} was not read: {error}") from None
