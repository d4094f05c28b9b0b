"""A text file's token ids, tokenized in chunks of bounded size.

Tokenizing a corpus in one call holds the tokenizer's whole output at once (a fast
tokenizer keeps offsets, type ids and masks beside every id) and runs on one thread.
Here the text is read as it is decoded, cut into chunks of about ``CHUNK_CHARS``
characters, and the chunks of a batch are encoded in one call, which a fast tokenizer
spreads over its threads; only the ids are kept, in the smallest integer type of the
vocabulary. ``data.tokenizer: model`` reads ``train.txt`` and ``val.txt`` this way, and
``dtp tokenize`` writes the ids to ``train.npy`` and ``val.npy`` for ``data.tokenizer:
pretokenized``.

A chunk ends only where cutting leaves the tokens as they are: at a boundary between a
whitespace and a non-whitespace character (never inside a word or a run of spaces or
newlines) whose ``WINDOW`` characters either side tokenize to the same ids cut and
whole. Byte-level BPE (GPT-2's kind) and SentencePiece-style tokenizers (a "▁" put
before every call's text) pass before most spaces, which they join to the word after
them; a tokenizer that passes nowhere tokenizes its text as one chunk, as it would
whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from .errors import UsageError

Encode = Callable[[list[str]], list[list[int]]]

CHUNK_CHARS = 1 << 16  # characters a chunk is cut near
BATCH = 32  # chunks a tokenizer call encodes (its threads share them)
WINDOW = 128  # characters each side of a cut whose tokens must not change
CHECKS = 16  # cut positions tried per chunk before more text is read
READ_CHARS = 1 << 16  # characters read at a time


def model_encoder(
    path: str | Path, field: str = "model.path", bytes_option: str = "data.tokenizer=bytes"
) -> tuple[Encode, int]:
    """The tokenizer saved in `path` (never downloaded) as a batch encoder without special
    tokens, and its vocabulary size; a directory with no tokenizer is an error naming
    `field`, the setting that gave `path`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"no tokenizer could be read from {field} = {str(path)!r} "
            f"({type(error).__name__}: {error}); save the model's tokenizer there "
            f"(tokenizer.save_pretrained), or use {bytes_option} for a byte-level model"
        ) from None

    def encode(texts: list[str]) -> list[list[int]]:
        # verbose=False: a chunk longer than the model's context is not a mistake here
        return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    return encode, len(tokenizer)


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id of a vocabulary of this size."""
    for kind in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(kind).max:
            return np.dtype(kind)
    return np.dtype(np.int64)


def read_text(path: Path, read_chars: int | None = None) -> Iterator[str]:
    """`path`'s UTF-8 text in pieces of `read_chars` (READ_CHARS) characters, its newlines
    read as Python reads text ("\\r\\n" and "\\r" are "\\n"); text that is not UTF-8 is an
    error naming the file."""
    with open(path, encoding="utf-8") as file:
        while True:
            try:
                piece = file.read(read_chars or READ_CHARS)
            except UnicodeDecodeError as error:
                raise UsageError(f"{path} is not UTF-8 text: {error}") from None
            if not piece:
                return
            yield piece


def exact_cut(encode: Encode, text: str, at: int) -> bool:
    """Whether the WINDOW characters either side of `at` tokenize the same cut there as
    whole."""
    left, right = text[max(0, at - WINDOW) : at], text[at : at + WINDOW]
    whole, first, second = encode([left + right, left, right])
    return list(whole) == list(first) + list(second)


# a whitespace and a non-whitespace character meet: just after a newline, just before a space
EDGE = re.compile(r"(?<=\n)(?=\S)|(?<=\S)(?= )")


def find_cut(encode: Encode, text: str, high: int, low: int) -> int | None:
    """The highest exact cut in (low, high] among the CHECKS whitespace edges nearest
    `high`."""
    edges = [m.start() for m in EDGE.finditer(text, low + 1, high + 1)]
    for at in reversed(edges[-CHECKS:]):
        if exact_cut(encode, text, at):
            return at
    return None


def chunks(path: Path, encode: Encode, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """`path`'s text as consecutive chunks that join to it, each cut at an exact cut
    near `chunk_chars` characters. Where no exact cut is found the chunk grows: the next
    search waits for twice the text, so a tokenizer that allows no cut reads the file
    once, as one chunk."""
    pieces: list[str] = []
    held = 0
    wait = chunk_chars + WINDOW  # characters to hold before a cut is looked for
    searched = 0  # positions below this were searched
    for piece in read_text(path):
        pieces.append(piece)
        held += len(piece)
        while held >= wait:
            text = "".join(pieces)
            # first near chunk_chars; after a failure, in the text read since
            high = len(text) - WINDOW if searched else min(chunk_chars, len(text) - WINDOW)
            cut = find_cut(encode, text, high, searched)
            if cut is None:
                pieces, searched, wait = [text], len(text) - WINDOW, 2 * len(text)
                break
            yield text[:cut]
            pieces, held = [text[cut:]], len(text) - cut
            searched, wait = 0, chunk_chars + WINDOW
    text = "".join(pieces)
    if text:
        yield text


def token_arrays(
    path: Path,
    encode: Encode,
    dtype: np.dtype,
    chunk_chars: int = CHUNK_CHARS,
    batch: int = BATCH,
) -> Iterator[np.ndarray]:
    """The token ids of `path`'s chunks, in order, one array of `dtype` a chunk."""
    top = np.iinfo(dtype).max

    def encoded(texts: list[str]) -> Iterator[np.ndarray]:
        for ids in encode(texts):
            array = np.asarray(ids, np.int64)
            bad = array[(array < 0) | (array > top)]
            if len(bad):
                raise UsageError(f"{path}: the tokenizer gave id {int(bad[0])}, outside 0..{top}")
            yield array.astype(dtype)

    texts: list[str] = []
    for text in chunks(path, encode, chunk_chars):
        texts.append(text)
        if len(texts) == batch:
            yield from encoded(texts)
            texts = []
    if texts:
        yield from encoded(texts)


def npy_header(dtype: np.dtype, count: int, size: int = 0) -> bytes:
    """A version 1.0 .npy header of a one-dimensional array, padded with spaces to `size`
    bytes (or the next multiple of 64), so that a header written for a larger count can
    be rewritten in place."""
    text = f"{{'descr': '{np.dtype(dtype).str}', 'fortran_order': False, 'shape': ({count},), }}"
    body = len(text) + 1  # and its newline
    total = size or -(-(10 + body) // 64) * 64
    if total - 10 < body:
        raise ValueError(f"a header of {total} bytes cannot hold {text}")
    text += " " * (total - 10 - body) + "\n"
    return b"\x93NUMPY\x01\x00" + (total - 10).to_bytes(2, "little") + text.encode("latin1")


def write_npy(arrays: Iterable[np.ndarray], path: Path, dtype: np.dtype) -> int:
    """The concatenation of `arrays` written to `path` as a .npy file as they come (the
    whole is never in memory): written to a temporary file beside it, renamed at the
    end. Returns the count of ids."""
    dtype = np.dtype(dtype).newbyteorder("<")
    size = len(npy_header(dtype, np.iinfo(np.int64).max))  # room for any count
    temporary = path.with_name(path.name + ".partial")
    count = 0
    try:
        with open(temporary, "wb") as file:
            file.write(npy_header(dtype, 0, size))
            for array in arrays:
                file.write(np.ascontiguousarray(array, dtype).tobytes())
                count += len(array)
            file.seek(0)
            file.write(npy_header(dtype, count, size))
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
    return count


def text_ids(path: Path, encode: Encode, vocab_size: int, **chunking: int) -> np.ndarray:
    """`path`'s token ids, in one array of the vocabulary's smallest type."""
    dtype = id_dtype(vocab_size)
    arrays = list(token_arrays(path, encode, dtype, **chunking))
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)
