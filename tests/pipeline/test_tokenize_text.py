"""Text tokenized in chunks (dtp_kernels/pipeline/tokenize_text.py, `dtp tokenize`): the
ids of every kind of tokenizer equal the whole text's, chunks are cut only where the
tokens do not change, the .npy files are written as the ids come, and `dtp prune` reads
them as it reads the text."""

from __future__ import annotations

import itertools
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from test_causal_lm import lm_recipe, save_llama

from dtp_kernels.cli import main
from dtp_kernels.pipeline import tokenize_text
from dtp_kernels.pipeline.errors import UsageError
from dtp_kernels.pipeline.run import build_data
from dtp_kernels.pipeline.tokenize_text import (
    chunks,
    id_dtype,
    read_text,
    text_ids,
    token_arrays,
    write_npy,
)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHUNK = 600  # characters: many cuts in a small text


def awkward_text(chars: int = 60_000) -> str:
    """Python source of the standard library with what cuts get wrong: runs of blank
    lines and of spaces, tabs and characters of 2, 3 and 4 bytes."""
    source = ""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source += path.read_text(encoding="utf-8", errors="ignore")
        if len(source) >= chars:
            break
    source = source[:chars].replace("\n\n", "\n\n\n \t\n").replace("    return", "  \t\n  return")
    return source.replace("def ", "déf € 𝄞 ")


def built_tokenizer(kind: str, text: str):
    """A transformers tokenizer trained here on `text`: byte-level BPE (GPT-2's kind),
    SentencePiece-style BPE (a "▁" prepended to every call), BPE without a pre-tokenizer,
    whole words, or one that prepends a letter to every call (so no cut is exact)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if kind == "words":
        words = sorted(set(text.split()))
        core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return transformers.PreTrainedTokenizerFast(tokenizer_object=core)
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    alphabet = []
    if kind == "byte_level":
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind in ("sentencepiece", "prepends"):
        core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if kind == "prepends":
        core.normalizer = normalizers.Prepend("Q")
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>"], initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator([text], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def encoder(tokenizer):
    return lambda texts: tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text(awkward_text(), encoding="utf-8")
    return path


KINDS = ["byte_level", "sentencepiece", "no_pre_tokenizer", "words", "prepends"]


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_ids_equal_the_whole_texts(text_file, kind):
    text = text_file.read_text(encoding="utf-8")
    tokenizer = built_tokenizer(kind, text)
    whole = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    pieces = list(chunks(text_file, encoder(tokenizer), CHUNK))
    assert "".join(pieces) == text
    ids = text_ids(text_file, encoder(tokenizer), len(tokenizer), chunk_chars=CHUNK)
    assert ids.dtype == np.uint16 and ids.tolist() == whole
    if kind == "prepends":  # every cut would add a "Q": the text is one chunk
        assert len(pieces) == 1
    elif kind == "no_pre_tokenizer":  # merges may cross a space: fewer cuts are exact
        assert len(pieces) > 10
    else:  # cut near every CHUNK characters
        assert len(pieces) > 0.8 * len(text) / CHUNK


def test_a_cut_left_unchecked_changes_the_tokens(text_file, monkeypatch):
    """The control: cut at the same whitespace edges without the check, a
    SentencePiece-style tokenizer's ids differ from the whole text's."""
    text = text_file.read_text(encoding="utf-8")
    tokenizer = built_tokenizer("sentencepiece", text)
    whole = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    monkeypatch.setattr(tokenize_text, "exact_cut", lambda encode, text, at: True)
    ids = text_ids(text_file, encoder(tokenizer), len(tokenizer), chunk_chars=CHUNK)
    assert ids.tolist() != whole


def test_chunks_are_cut_at_whitespace_edges_and_stay_near_their_size(text_file):
    text = text_file.read_text(encoding="utf-8")
    tokenizer = built_tokenizer("byte_level", text)
    calls = []

    def counted(texts):
        calls.append(len(texts))
        return encoder(tokenizer)(texts)

    pieces = list(chunks(text_file, counted, CHUNK))
    for piece, after in itertools.pairwise(pieces):
        assert len(piece) <= CHUNK
        assert piece[-1].isspace() != after[0].isspace()
        assert piece[-1] == "\n" or after[0] == " "
    arrays = list(token_arrays(text_file, encoder(tokenizer), np.dtype(np.uint16), CHUNK, 7))
    assert len(arrays) == len(pieces)
    calls.clear()
    list(token_arrays(text_file, counted, np.dtype(np.uint16), CHUNK, 7))
    assert max(calls) == 7  # the batch, and the cut checks' three texts


def test_a_tokenizer_that_allows_no_cut_reads_the_text_once(text_file, monkeypatch):
    """No exact cut anywhere: the chunk grows by doubling, so the text is joined a
    logarithmic number of times, not once per piece read."""
    joined = []

    def never(encode, text, high, low):
        joined.append(len(text))
        return None

    monkeypatch.setattr(tokenize_text, "find_cut", never)
    monkeypatch.setattr(tokenize_text, "READ_CHARS", 1000)
    pieces = list(chunks(text_file, lambda texts: [[0]] * len(texts), CHUNK))
    assert pieces == [text_file.read_text(encoding="utf-8")]
    assert 0 < len(joined) <= 8


def test_text_is_read_in_pieces_as_python_reads_it(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("aé€𝄞b\r\nc\rd\n".encode() * 50)
    assert "".join(read_text(path, read_chars=3)) == path.read_text(encoding="utf-8")
    path.write_bytes(b"abc\n" * 10 + b"\xff\xfe tail")
    with pytest.raises(UsageError, match=r"t\.txt is not UTF-8 text: .*byte 0xff"):
        list(read_text(path, read_chars=7))


@pytest.mark.parametrize(
    ("vocab", "kind"),
    [(256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32), (2**33, np.int64)],
)
def test_ids_take_the_smallest_type_of_the_vocabulary(vocab, kind):
    assert id_dtype(vocab) == kind


@pytest.mark.parametrize("count", [0, 1, 37, 70_000])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_npy_files_are_written_as_the_ids_come(tmp_path, count, dtype):
    ids = (np.arange(count, dtype=np.int64) * 7919) % 250
    parts = np.array_split(ids.astype(dtype), 5)
    path = tmp_path / "ids.npy"
    assert write_npy(iter(parts), path, np.dtype(dtype)) == count
    loaded = np.load(path, mmap_mode="r", allow_pickle=False)
    assert loaded.dtype == dtype and loaded.shape == (count,)
    assert np.array_equal(loaded, ids)
    assert path.stat().st_size % 64 == (count * np.dtype(dtype).itemsize) % 64  # aligned header


def test_a_write_that_fails_leaves_no_file(tmp_path):
    def failing():
        yield np.zeros(10, np.uint16)
        raise UsageError("tokenizer broke")

    path = tmp_path / "ids.npy"
    with pytest.raises(UsageError, match="tokenizer broke"):
        write_npy(failing(), path, np.dtype(np.uint16))
    assert list(tmp_path.iterdir()) == []


def test_ids_outside_the_vocabularys_type_are_refused(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a b c")
    with pytest.raises(UsageError, match=r"t\.txt: the tokenizer gave id 256, outside 0\.\.255"):
        list(token_arrays(path, lambda texts: [[3, 256]] * len(texts), np.dtype(np.uint8)))


def save_text_and_tokenizer(tmp_path) -> tuple[Path, Path, object]:
    """train.txt, val.txt and a tiny Llama with a byte-level BPE tokenizer saved beside
    it."""
    text = awkward_text(30_000)
    root = tmp_path / "text"
    root.mkdir()
    (root / "train.txt").write_text(text[:24_000], encoding="utf-8")
    (root / "val.txt").write_text(text[24_000:], encoding="utf-8")
    tokenizer = built_tokenizer("byte_level", text)
    model_dir = save_llama(tmp_path / "llama", vocab=len(tokenizer))
    tokenizer.save_pretrained(model_dir)
    return root, model_dir, tokenizer


def test_dtp_tokenize_writes_ids_that_train_as_the_text(tmp_path, capsys):
    root, model_dir, tokenizer = save_text_and_tokenizer(tmp_path)
    out = tmp_path / "ids"
    out.mkdir()
    assert main(["tokenize", str(root), "--tokenizer", str(model_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("train", "val"):
        whole = tokenizer(
            (root / f"{name}.txt").read_text(encoding="utf-8"),
            add_special_tokens=False,
            verbose=False,
        )["input_ids"]
        ids = np.load(out / f"{name}.npy", allow_pickle=False)
        assert ids.dtype == np.uint16 and ids.tolist() == whole
        assert f'"tokens": {len(whole)}' in printed
    # the pretokenized files give the blocks the text gives under data.tokenizer=model
    vocab = len(tokenizer)
    from_text = build_data(lm_recipe(model_dir, root, "data.tokenizer=model"), vocab_size=vocab)
    from_ids = build_data(
        lm_recipe(model_dir, out, "data.tokenizer=pretokenized"), vocab_size=vocab
    )
    (text_train, text_val), (ids_train, ids_val) = from_text, from_ids
    for a, b in (
        (text_train.dataset.dataset, ids_train.dataset.dataset),
        (text_val.dataset, ids_val.dataset),
    ):
        assert len(a) == len(b) > 0 and np.array_equal(a.ids, b.ids)
        assert all(torch.equal(x, y) for x, y in zip(a[len(a) - 1], b[len(b) - 1], strict=True))


def test_dtp_tokenize_bytes_and_its_refusals(tmp_path, capsys):
    root = tmp_path / "text"
    root.mkdir()
    (root / "train.txt").write_bytes("naïve\n".encode() * 1000)
    assert main(["tokenize", str(root), "--tokenizer", "bytes"]) == 2
    assert "val.txt" in capsys.readouterr().err
    (root / "val.txt").write_bytes(b"val\n")
    assert main(["tokenize", str(root), "--tokenizer", "bytes"]) == 0
    ids = np.load(root / "train.npy")
    assert ids.dtype == np.uint8 and ids.tobytes() == (root / "train.txt").read_bytes()
    assert main(["tokenize", str(root), "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert "train.npy" in err and "--overwrite" in err
    assert main(["tokenize", str(root), "--tokenizer", "bytes", "--overwrite"]) == 0
    argv = ["tokenize", str(root), "--tokenizer", str(tmp_path), "--overwrite"]
    assert main(argv) == 2
    assert "no tokenizer could be read from --tokenizer" in capsys.readouterr().err
    assert np.load(root / "train.npy").tobytes() == (root / "train.txt").read_bytes()  # kept
    assert main(["tokenize", str(root), "--tokenizer", "bytes", "--out", str(tmp_path / "no")]) == 2
    assert "--out" in capsys.readouterr().err
