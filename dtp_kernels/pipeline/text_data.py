"""Text for causal language models (``data.name: text``).

``data.root`` holds the training and evaluation text, in one of two forms:

- ``train.txt`` and ``val.txt``, UTF-8 text, tokenized by the model's own tokenizer
  (``data.tokenizer: model``, read from ``model.path``, never downloaded; in chunks cut
  where the tokens do not change, tokenize_text.py) or as bytes (``bytes``: a token's
  id is the byte's value, for byte-level models);
- ``train.npy`` and ``val.npy`` (``data.tokenizer: pretokenized``), one-dimensional
  integer arrays of token ids written by the user's own tokenization (``numpy.save``),
  memory-mapped, never read whole into memory: for corpora larger than memory, and so
  that runs and ranks do not tokenize again.

The token ids are held once, in the smallest integer type that holds them (one byte a
token for bytes, two for vocabularies up to 65,536), and cut into consecutive blocks of
``data.seq_len`` input tokens as they are read; a block's targets are the same tokens
moved on by one, the next token at every position. Tokens after the last whole block are
left out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import UsageError
from .tokenize_text import model_encoder, text_ids

TEXT_FILES = ("train.txt", "val.txt")  # training, evaluation
ID_FILES = ("train.npy", "val.npy")
TOKENIZERS = ("model", "bytes", "pretokenized")


class TokenBlocks(Dataset):
    """Block `i` of a token stream: (inputs, targets), int64 tensors of `seq_len` tokens,
    the targets one token on. The stream stays in its compact type (or memory-mapped
    file) and only a block's tokens are widened, when it is read."""

    def __init__(self, ids: np.ndarray, seq_len: int, path: Path) -> None:
        count = (len(ids) - 1) // seq_len
        if count < 1:
            raise UsageError(
                f"{path} holds {len(ids)} tokens, fewer than data.seq_len + 1 = "
                f"{seq_len + 1} (one block of inputs and its next tokens)"
            )
        self.ids, self.seq_len, self.count, self.path = ids, seq_len, count, path

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.count <= index < self.count:
            raise IndexError(f"block {index} of {self.count} in {self.path}")
        start = (index % self.count) * self.seq_len
        window = torch.from_numpy(np.array(self.ids[start : start + self.seq_len + 1], np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:
        # A memory-mapped stream is opened again by a loader worker, not pickled whole.
        state = dict(self.__dict__)
        if isinstance(self.ids, np.memmap):
            state["ids"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.ids is None:
            self.ids = np.load(self.path, mmap_mode="r", allow_pickle=False)


def compact(ids: np.ndarray) -> np.ndarray:
    """`ids` (non-negative) in the smallest unsigned type that holds their largest."""
    top = int(ids.max()) if len(ids) else 0
    for kind in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(kind).max:
            return ids.astype(kind)
    return ids.astype(np.int64)


def tokenizer(kind: str, model_path: str | Path) -> Callable[[Path], np.ndarray]:
    """A function from a data file to its token ids (a one-dimensional integer array)."""
    if kind not in TOKENIZERS:
        raise UsageError(f"data.tokenizer = {kind!r}; allowed: {list(TOKENIZERS)}")
    if kind == "bytes":
        return lambda path: np.frombuffer(path.read_bytes(), np.uint8)
    if kind == "pretokenized":
        return read_ids
    encode, vocab_size = model_encoder(model_path)
    return lambda path: compact(text_ids(path, encode, vocab_size))


def read_ids(path: Path) -> np.ndarray:
    """The token ids of a .npy file, memory-mapped; anything but a one-dimensional array
    of integers is an error naming the file."""
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise UsageError(
            f"{path} is not a .npy array of token ids ({type(error).__name__}: {error}); "
            "write one with numpy.save(path, ids), ids a one-dimensional integer array"
        ) from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise UsageError(
            f"{path} holds a {ids.ndim}-dimensional {ids.dtype} array; data.tokenizer = "
            "'pretokenized' reads a one-dimensional integer array of token ids"
        )
    return ids


def text(
    root: str | Path | None,
    seq_len: int,
    kind: str,
    model_path: str | Path,
    vocab_size: int | None = None,
) -> tuple[TokenBlocks, TokenBlocks]:
    """The training and evaluation blocks of `root`'s train and val files; a token id
    outside the model's vocabulary (`vocab_size`, when given) is an error naming the
    file."""
    if root is None:
        raise UsageError(
            "data.name = 'text' needs data.root, a directory with train.txt and val.txt "
            "(or, under data.tokenizer = 'pretokenized', train.npy and val.npy)"
        )
    root = Path(root)
    files = ID_FILES if kind == "pretokenized" else TEXT_FILES
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        what = (
            "one-dimensional integer arrays of token ids (numpy.save)"
            if kind == "pretokenized"
            else "UTF-8 text"
        )
        raise FileNotFoundError(
            f"data.root = {str(root)!r} has no {' or '.join(missing)}: data.name = 'text' "
            f"with data.tokenizer = {kind!r} reads {files[0]} (training) and {files[1]} "
            f"(evaluation), {what}"
        )
    encode = tokenizer(kind, model_path)
    sets = []
    for name in files:
        ids = encode(root / name)
        if len(ids) and int(ids.min()) < 0:
            raise UsageError(
                f"{root / name} has token id {int(ids.min())}; token ids are 0 or more"
            )
        if vocab_size is not None and len(ids) and int(ids.max()) >= vocab_size:
            raise UsageError(
                f"{root / name} has token id {int(ids.max())} under data.tokenizer = "
                f"{kind!r}, outside the model's vocabulary of {vocab_size} (bytes need 256)"
            )
        sets.append(TokenBlocks(ids, seq_len, root / name))
    return sets[0], sets[1]
