"""Tokenizing a text file for `dtp prune`: in one call on the whole text (how
data.tokenizer=model read train.txt before it was chunked) against in chunks
(dtp_kernels/pipeline/tokenize_text.py, also behind `dtp tokenize`), each run in a fresh
process, interleaved: wall time and the peak resident memory the tokenization added, with
a byte-level BPE tokenizer (GPT-2's kind) trained here on the text.

    python benchmarks/bench_tokenize.py [--mb 16] [--rounds 3] [--no-save]

The table goes to results/tokenize_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WAYS = ("whole", "chunked")


def write_corpus(path: Path, megabytes: float) -> None:
    """The standard library's Python source, repeated to `megabytes` of UTF-8 text."""
    source = "".join(
        p.read_text(encoding="utf-8", errors="ignore")
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    )
    size = int(megabytes * 2**20)
    path.write_text((source * (size // len(source) + 1))[:size], encoding="utf-8")


def save_tokenizer(where: Path, corpus: Path) -> None:
    """A byte-level BPE tokenizer of 8,000 tokens trained on the corpus's first 2 MB."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    with open(corpus, encoding="utf-8") as file:
        core.train_from_iterator([file.read(2 * 2**20)], trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(where)


def status_kib(field: str) -> int:
    """A memory figure of this process's /proc status (Linux), in KiB."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """The peak resident set (VmHWM) set back to the resident set now (Linux 4.0 on)."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")


def worker(way: str, corpus: Path, tokenizer_dir: Path) -> None:
    """One tokenization in this process; prints its seconds, its peak resident memory
    above the resident memory before it and a digest of the ids."""
    from dtp_kernels.pipeline.text_data import compact
    from dtp_kernels.pipeline.tokenize_text import model_encoder, text_ids

    encode, vocab_size = model_encoder(tokenizer_dir)
    encode(["warm the tokenizer up"])
    reset_peak()
    before = status_kib("VmRSS")
    start = time.perf_counter()
    if way == "whole":
        text = corpus.read_text(encoding="utf-8")
        ids = compact(np.asarray(encode([text])[0], np.int64))
        del text
    else:
        ids = compact(text_ids(corpus, encode, vocab_size))
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    digest = int(np.asarray(ids, np.int64) @ (np.arange(len(ids)) % 1009 + 1))
    record = {"seconds": seconds, "peak_mib": (peak - before) / 1024, "tokens": len(ids)}
    print(json.dumps({**record, "digest": digest, "dtype": ids.dtype.name}))


def run_once(way: str, corpus: Path, tokenizer_dir: Path) -> dict:
    script = [sys.executable, __file__, "--worker", way, str(corpus), str(tokenizer_dir)]
    done = subprocess.run(script, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: dict[str, list[dict]], megabytes: float, environment: dict) -> str:
    import tokenizers
    import transformers

    lines = [
        f"# Tokenizing {megabytes:g} MB of text: one call on the whole text against chunks",
        "",
        f"device: {environment['device']}; torch {environment['torch']}; tokenizers "
        f"{tokenizers.__version__}; transformers {transformers.__version__}; date "
        f"{environment['date']}; a byte-level BPE tokenizer of 8,000 tokens; each run in a "
        f"fresh process, {len(rows['whole'])} interleaved rounds, medians",
        "",
        "| way | seconds | peak memory added (MiB) | tokens | x faster than whole |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    whole = statistics.median(r["seconds"] for r in rows["whole"])
    for way in WAYS:
        seconds = statistics.median(r["seconds"] for r in rows[way])
        peak = statistics.median(r["peak_mib"] for r in rows[way])
        lines.append(
            f"| {way} | {seconds:.2f} | {peak:.0f} | {rows[way][0]['tokens']:,} | "
            f"{whole / seconds:.2f} |"
        )
    lines += [
        "",
        "whole: `tokenizer(text)` on the file read whole, then the ids in their smallest "
        "type; chunked: `tokenize_text.text_ids` (chunks of 65,536 characters cut where the "
        "tokens do not change, 32 a call). The ids of both are the same (checked by digest "
        "in every round). Peak memory added: the process's peak resident set above its "
        "resident set just before, the tokenizer loaded.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("WAY", "CORPUS", "TOKENIZER"))
    args = parser.parse_args()
    if args.worker:
        way, corpus, tokenizer_dir = args.worker
        worker(way, Path(corpus), Path(tokenizer_dir))
        return
    import torch
    from _harness import RESULTS, environment

    with tempfile.TemporaryDirectory() as tmp:
        corpus, tokenizer_dir = Path(tmp) / "train.txt", Path(tmp) / "tokenizer"
        write_corpus(corpus, args.mb)
        save_tokenizer(tokenizer_dir, corpus)
        rows: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                rows[way].append(run_once(way, corpus, tokenizer_dir))
            digests = {rows[way][-1]["digest"] for way in WAYS}
            if len(digests) != 1:
                raise SystemExit("the chunked ids differ from the whole text's")
    text = table(rows, args.mb, environment(torch.device("cpu")))
    print(text)
    if not args.no_save:
        (RESULTS / "tokenize_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
