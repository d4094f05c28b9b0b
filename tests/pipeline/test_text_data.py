"""Text data for causal language models (dtp_kernels/pipeline/text_data.py): token ids
held once in their smallest type, or memory-mapped from the user's own .npy files
(data.tokenizer: pretokenized), cut into blocks as they are read; a run on the .npy
ids of a text equals the run on the text."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from test_causal_lm import (
    SEQ,
    blocks,
    llama_with_word_tokenizer,
    lm_recipe,
    save_llama,
    stacked,
    write_text,
)

from dtp_kernels.pipeline.data import default_workers
from dtp_kernels.pipeline.errors import UsageError
from dtp_kernels.pipeline.run import build_data, run
from dtp_kernels.pipeline.text_data import compact, read_ids

pytest.importorskip("transformers")


def write_ids(where, train: np.ndarray, val: np.ndarray):
    where.mkdir(parents=True, exist_ok=True)
    np.save(where / "train.npy", train)
    np.save(where / "val.npy", val)
    return where


def byte_ids(text, dtype) -> tuple[np.ndarray, np.ndarray]:
    return tuple(
        np.frombuffer((text / name).read_bytes(), np.uint8).astype(dtype)
        for name in ("train.txt", "val.txt")
    )


def test_blocks_are_the_next_tokens_read_from_the_compact_stream(tmp_path):
    text = write_text(tmp_path / "text")
    train, test = build_data(lm_recipe(save_llama(tmp_path / "llama"), text), vocab_size=256)
    assert test.dataset.ids.dtype == np.uint8  # one byte a token, not 24 (int64 x 3)
    assert default_workers(train.dataset.dataset) == 0  # nothing to decode
    inputs, targets = stacked(test.dataset)
    expected = blocks(text / "val.txt")
    assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])
    assert inputs.dtype == targets.dtype == torch.int64
    assert len(train.dataset) == (12000 - 1) // SEQ
    assert torch.equal(test.dataset[-1][0], expected[0][-1])
    with pytest.raises(IndexError, match="block 93 of 93"):
        test.dataset[len(test.dataset)]


@pytest.mark.parametrize(
    ("top", "kind"),
    [(255, np.uint8), (256, np.uint16), (65535, np.uint16), (65536, np.uint32), (2**32, np.int64)],
)
def test_ids_are_held_in_the_smallest_type_that_holds_them(top, kind):
    ids = compact(np.array([0, 7, top], np.int64))
    assert ids.dtype == kind and ids.tolist() == [0, 7, top]


def test_the_models_tokenizer_ids_are_held_in_two_bytes(tmp_path):
    text = write_text(tmp_path / "text")
    tokenizer = llama_with_word_tokenizer(tmp_path / "llama", text)
    settings = lm_recipe(tmp_path / "llama", text, "data.tokenizer=model")
    _, test = build_data(settings, vocab_size=len(tokenizer))
    assert 256 < len(tokenizer) <= 65536 and test.dataset.ids.dtype == np.uint16
    ids = tokenizer((text / "val.txt").read_text(), add_special_tokens=False)["input_ids"]
    assert test.dataset[1][0].tolist() == ids[SEQ : 2 * SEQ]


def test_pretokenized_ids_are_memory_mapped_and_train_as_the_text(tmp_path):
    """The bytes of train.txt/val.txt saved as int32 .npy files: the data set maps the
    files (no copy), and `dtp prune` on them ends with the summary and weights of the
    run on the text."""
    model_dir, text = save_llama(tmp_path / "llama"), write_text(tmp_path / "text")
    ids = write_ids(tmp_path / "ids", *byte_ids(text, np.int32))
    from_ids = lm_recipe(model_dir, ids, "data.tokenizer=pretokenized")
    train, test = build_data(from_ids, vocab_size=256)
    assert (
        isinstance(train.dataset.dataset.ids, np.memmap)
        and train.dataset.dataset.ids.dtype == np.int32
    )
    assert torch.equal(stacked(test.dataset)[1], blocks(text / "val.txt")[1])
    overrides = ("prune.epochs=1", "finetune.epochs=1", "data.batch_size=32")
    expected = run(lm_recipe(model_dir, text, *overrides), tmp_path / "text_run")
    summary = run(
        lm_recipe(model_dir, ids, "data.tokenizer=pretokenized", *overrides), tmp_path / "ids_run"
    )
    for key in ("perplexity", "dense_perplexity", "perplexity_before_finetune", "accuracy"):
        assert summary[key] == expected[key], key
    for (name, a), (_, b) in zip(
        expected["model"].state_dict().items(), summary["model"].state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert not (tmp_path / "ids_run" / "pruned" / "tokenizer_config.json").exists()


def test_a_loader_worker_opens_the_file_again_instead_of_copying_it(tmp_path):
    ids = np.arange(40_000, dtype=np.uint16) % 1000
    root = write_ids(tmp_path / "ids", ids, ids[:5000])
    model_dir = save_llama(tmp_path / "llama", vocab=1000)
    settings = lm_recipe(model_dir, root, "data.tokenizer=pretokenized")
    train, _ = build_data(settings, vocab_size=1000)
    dataset = train.dataset.dataset
    state = pickle.dumps(dataset)
    assert len(state) < 2000  # the path, not the 80 kB of ids
    again = pickle.loads(state)
    assert isinstance(again.ids, np.memmap)
    assert all(torch.equal(a, b) for a, b in zip(again[17], dataset[17], strict=True))
    settings["data"]["num_workers"] = 0
    serial = [b[0] for b in build_data(settings, vocab_size=1000)[0]]
    settings["data"]["num_workers"] = 2
    settings["data"]["persistent_workers"] = False
    workers = [b[0] for b in build_data(settings, vocab_size=1000)[0]]
    assert len(serial) == len(workers) > 1
    assert all(torch.equal(a, b) for a, b in zip(serial, workers, strict=True))


def test_pretokenized_runs_copy_the_tokenizer_when_the_model_has_one(tmp_path):
    text = write_text(tmp_path / "text")
    tokenizer = llama_with_word_tokenizer(tmp_path / "llama", text)
    ids = [
        np.asarray(tokenizer((text / n).read_text())["input_ids"], np.int64)
        for n in ("train.txt", "val.txt")
    ]
    root = write_ids(tmp_path / "ids", *ids)
    settings = lm_recipe(tmp_path / "llama", root, "data.tokenizer=pretokenized", "prune.method=l1")
    settings["data"]["seq_len"] = 16
    run(settings, tmp_path / "run")
    import transformers

    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "pruned")
    assert saved("def return")["input_ids"] == tokenizer("def return")["input_ids"]


@pytest.mark.parametrize(
    ("train", "message"),
    [
        (lambda: np.zeros((4, 100), np.int32), r"train.npy holds a 2-dimensional int32 array"),
        (lambda: np.zeros(100, np.float32), r"train.npy holds a 1-dimensional float32 array"),
        (
            lambda: np.array([1, "a", None] * 40, object),
            r"train.npy is not a .npy array of token ids",
        ),
        (
            lambda: np.array([3, -1] * 60, np.int64),
            r"train.npy has token id -1; token ids are 0 or",
        ),
        (
            lambda: np.array([3, 256] * 60, np.int16),
            r"train.npy has token id 256 .* vocabulary of 256",
        ),
        (
            lambda: np.arange(SEQ, dtype=np.int64),
            r"train.npy holds 32 tokens, fewer than data.seq_len",
        ),
        (None, r"has no train.npy: .* reads train.npy \(training\) and val.npy"),
    ],
)
def test_bad_token_files_are_refused_naming_the_file(tmp_path, train, message):
    root = tmp_path / "ids"
    root.mkdir()
    if train is not None:
        np.save(root / "train.npy", train(), allow_pickle=True)
    np.save(root / "val.npy", np.arange(200) % 256)
    settings = lm_recipe(save_llama(tmp_path / "llama"), root, "data.tokenizer=pretokenized")
    with pytest.raises((UsageError, FileNotFoundError), match=message):
        run(settings, tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_file_that_is_not_an_array_is_refused_naming_it(tmp_path):
    (tmp_path / "train.npy").write_text("not an array")
    with pytest.raises(UsageError, match=r"train.npy is not a .npy array of token ids"):
        read_ids(tmp_path / "train.npy")
