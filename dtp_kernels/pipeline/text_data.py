"""Text for causal language models (``data.name: text``).

``data.root`` holds ``train.txt`` and ``val.txt``. Each file is tokenized whole, by the
model's own tokenizer (``data.tokenizer: model``, read from ``model.path``, never
downloaded) or as bytes (``bytes``: a token's id is the byte's value, for byte-level
models), held in memory and cut into consecutive blocks of ``data.seq_len`` input tokens;
a block's targets are the same tokens moved on by one, the next token at every position.
Tokens after the last whole block are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .errors import UsageError

FILES = ("train.txt", "val.txt")  # training, evaluation
TOKENIZERS = ("model", "bytes")


def tokenizer(kind: str, model_path: str | Path) -> Callable[[Path], torch.Tensor]:
    """A function from a text file to its token ids (int64)."""
    if kind not in TOKENIZERS:
        raise UsageError(f"data.tokenizer = {kind!r}; allowed: {list(TOKENIZERS)}")
    if kind == "bytes":
        return lambda path: torch.from_numpy(
            np.frombuffer(path.read_bytes(), np.uint8).astype(np.int64)
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"data.tokenizer = 'model': no tokenizer could be read from model.path = "
            f"{str(model_path)!r} ({type(error).__name__}: {error}); save the model's "
            "tokenizer there (tokenizer.save_pretrained), or use data.tokenizer=bytes for "
            "a byte-level model"
        ) from None

    def encode(path: Path) -> torch.Tensor:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise UsageError(f"{path} is not UTF-8 text: {error}") from None
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    return encode


def blocks(ids: torch.Tensor, seq_len: int, path: Path) -> TensorDataset:
    """(inputs, targets) of `ids` cut into blocks of `seq_len` tokens, targets one on."""
    count = (len(ids) - 1) // seq_len
    if count < 1:
        raise UsageError(
            f"{path} holds {len(ids)} tokens, fewer than data.seq_len + 1 = {seq_len + 1} "
            "(one block of inputs and its next tokens)"
        )
    inputs = ids[: count * seq_len].view(count, seq_len)
    targets = ids[1 : count * seq_len + 1].view(count, seq_len)
    return TensorDataset(inputs.clone(), targets.clone())


def text(
    root: str | Path | None,
    seq_len: int,
    kind: str,
    model_path: str | Path,
    vocab_size: int | None = None,
) -> tuple[TensorDataset, TensorDataset]:
    """The training and evaluation blocks of `root`'s train.txt and val.txt; a token id
    outside the model's vocabulary (`vocab_size`, when given) is an error naming the
    file."""
    if root is None:
        raise UsageError(
            "data.name = 'text' needs data.root, a directory with train.txt and val.txt"
        )
    root = Path(root)
    missing = [name for name in FILES if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"data.root = {str(root)!r} has no {' or '.join(missing)}: data.name = 'text' "
            f"reads {FILES[0]} (training) and {FILES[1]} (evaluation), UTF-8 text"
        )
    encode = tokenizer(kind, model_path)
    sets = []
    for name in FILES:
        ids = encode(root / name)
        if vocab_size is not None and len(ids) and int(ids.max()) >= vocab_size:
            raise UsageError(
                f"{root / name} has token id {int(ids.max())} under data.tokenizer = "
                f"{kind!r}, outside the model's vocabulary of {vocab_size} (bytes need 256)"
            )
        sets.append(blocks(ids, seq_len, root / name))
    return sets[0], sets[1]
