"""`make demo-transformers` at a few steps: both comparisons run end to end offline and
give a dense row and DTP and L1 rows at the same kept counts."""

import pytest

pytest.importorskip("timm")
pytest.importorskip("transformers")

from dtp_kernels import transformer_demo


def test_vit_digits_rows():
    rows = transformer_demo.vit_digits(seed=0, epochs=(1, 1, 1))
    assert [r["method"] for r in rows] == ["dense", "dtp", "l1"]
    assert rows[1]["params"] == rows[2]["params"] < rows[0]["params"]
    assert all(0.0 <= r["metric"] <= 1.0 for r in rows)


def test_llama_stdlib_rows_and_summary(capsys):
    runs = [transformer_demo.llama_stdlib(seed=s, steps=(4, 2, 2)) for s in (0, 1)]
    assert [r["method"] for r in runs[0]] == ["dense", "dtp", "l1"]
    assert runs[0][1]["params"] == runs[0][2]["params"] < runs[0][0]["params"]
    assert all(1.0 < r["metric"] < 300.0 for run in runs for r in run)  # 256 byte values
    summary = transformer_demo.summarize(runs)
    assert summary[1]["std"] > 0 and summary[0]["seconds"] is None
    transformer_demo.print_rows("title", "perplexity", summary, percent=False)
    assert "dtp" in capsys.readouterr().out


def test_mixtral_stdlib_rows_prune_half_the_experts():
    rows = transformer_demo.llama_stdlib(seed=0, steps=(4, 2, 2), experts=8)
    assert [r["method"] for r in rows] == ["dense", "dtp", "l1"]
    assert rows[1]["params"] == rows[2]["params"] < rows[0]["params"]
    assert all(1.0 < r["metric"] < 300.0 for r in rows)


def test_stdlib_text_is_split_by_file():
    train, held_out = transformer_demo.stdlib_bytes(200_000)
    assert len(train) >= 200_000 and len(held_out) >= 20_000
    assert int(train.max()) < 256


def test_nm_vs_magnitude_llama_rows(monkeypatch):
    """The N:M comparison on the Llama runs every method from one pre-trained model."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import nm_vs_magnitude

    monkeypatch.setattr(nm_vs_magnitude, "LLAMA_STEPS", (3, 2, 2))
    runs = nm_vs_magnitude.llama_runs("2:4", [0])
    assert set(runs) == {"l1", "dtp", "dtp-magnitude"}
    assert runs["l1"][0]["dense"] == runs["dtp"][0]["dense"] == runs["dtp-magnitude"][0]["dense"]
    assert runs["dtp"][0]["export"] != runs["dtp-magnitude"][0]["export"]  # other scores
    for (row,) in runs.values():
        assert all(1.0 < value < 300.0 for value in row.values())
