"""The Python examples in docs/ run as written. A block names what the reader brings (a
data loader, a loss, a model, the Trainer's arguments); each block's entry below (given
a temporary directory and pytest's monkeypatch) gives those names small real values,
runs the block and checks what it promises. A block
added to the docs without an entry here fails the first test."""

import math
import re
import textwrap
from pathlib import Path

import pytest
import torch

from dtp_kernels import load_pruned
from utils import tiny_llama

DOCS = Path(__file__).resolve().parents[1] / "docs"


def blocks() -> dict[tuple[str, int], str]:
    """Every ```python block of docs/*.md by (file name, index in the file)."""
    found = {}
    for path in sorted(DOCS.glob("*.md")):
        for index, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            found[(path.name, index)] = textwrap.dedent(code)  # a block inside a list item
    return found


def run(key: tuple[str, int], namespace: dict) -> dict:
    exec(compile(blocks()[key], f"docs/{key[0]} block {key[1]}", "exec"), namespace)
    return namespace


def test_every_block_has_an_entry_here():
    assert set(blocks()) == set(ENTRIES), "a Python block in docs/ is not run by this file"


def test_design_maps_every_pruning_file():
    """docs/design.md's map of the pruning layer names each of its files, and no other."""
    design = (DOCS / "design.md").read_text()
    table = design[design.index("| what users call |") :].split("\n\n")[0]
    mapped = set(re.findall(r"`(\w+\.py)`", table))
    files = {p.name for p in (DOCS.parent / "dtp_kernels" / "pruning").glob("*.py")}
    assert mapped == files - {"__init__.py"}, (sorted(files - mapped), sorted(mapped - files))


def ops_loop(tmp_path, monkeypatch):
    """docs/ops.md: the op in a training loop of 100 steps."""
    torch.manual_seed(0)
    weights = torch.randn(448)
    ns = run(("ops.md", 0), {"my_loss": lambda mask: (mask * weights).square().sum()})
    mask, keep, state = ns["mask"], ns["keep"], ns["state"]
    sums = torch.stack([part.sum() for part in mask.detach().split(ns["sizes"])])
    torch.testing.assert_close(sums, keep, rtol=1e-5, atol=1e-4)  # k per group
    assert int(state.steps) == 100  # committed once per step


def pruner_loop(tmp_path, monkeypatch):
    """docs/pruning.md: DTPPruner on ResNet-56 in a plain loop, export and save."""
    monkeypatch.chdir(tmp_path)  # the block saves resnet56_p70.pt where it runs
    torch.manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))) for _ in range(2)]
    ns = run(("pruning.md", 0), {"loader": loader})
    small, pruner = ns["small"], ns["pruner"]
    assert int(pruner.state.steps) == 2
    assert small.layer1[0].conv1.out_channels == 16 - math.ceil(16 * 0.7)
    loaded = load_pruned(tmp_path / "resnet56_p70.pt")
    x = torch.randn(2, 3, 32, 32)
    small.eval(), loaded.eval()
    torch.testing.assert_close(loaded(x), small(x))


def prepare_llama(tmp_path, monkeypatch):
    """docs/pruning.md: prepare() on a model and optimizer of one's own (a tiny Llama)."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(0))
    ns = run(("pruning.md", 1), {"model": model, "optimizer": optimizer, "example_inputs": (ids,)})
    small = ns["small"]
    assert (small.config.num_key_value_heads, small.config.intermediate_size) == (1, 24)
    assert optimizer.param_groups[-1]["params"] == [ns["pruner"].scores]


def prepare_gpt2(tmp_path, monkeypatch):
    """docs/pruning.md: GPT-2 from a checkpoint (a tiny one saved here), converted, then
    prepare(), a training step and export."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=61, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    namespace = {"checkpoint": str(tmp_path / "gpt2"), "example_inputs": (ids,)}
    ns = run(("pruning.md", 3), namespace)
    model, optimizer, pruner = ns["model"], ns["optimizer"], ns["pruner"]
    model.train()
    model(ids, labels=ids).loss.backward()  # the reader's loop, one step
    optimizer.step()
    assert int(pruner.state.steps) == 1
    small = ns["small"]
    assert [block.attn.num_heads for block in small.transformer.h] == [2, 2]
    assert small.transformer.h[0].mlp.c_fc.nf == 64  # transformers' Conv1D again
    generated = small.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 15)


def trainer_callback(tmp_path, monkeypatch):
    """docs/pruning.md: the Hugging Face Trainer callback, a few real Trainer steps."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the block saves to ./pruned
    ids = torch.randint(0, 61, (8, 12), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    ns = {
        "transformers": transformers,
        "model": tiny_llama(),
        "args": args,
        "data": [{"input_ids": row, "labels": row} for row in ids],
        "example_input_ids": ids[:1],
    }
    run(("pruning.md", 4), ns)
    assert int(ns["callback"].pruner.state.steps) == 2
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pruned")
    assert loaded.config.num_attention_heads == 2  # half the key/value heads, with their queries


def fsdp_llama(tmp_path, monkeypatch):
    """docs/pruning.md: the pruner made before FSDP2's fully_shard (one gloo rank here;
    tests/pruning/test_fsdp.py trains two), the scores joined to the optimizer made
    after it: export_sharded gives the smaller model, a step commits the state, and the
    sharded model's export() is refused."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        names = {"model": tiny_llama(), "example_inputs": (ids[:1],), "build_model": tiny_llama}
        ns = run(("pruning.md", 2), {**names, "ratios": {"heads": 0.5, "mlp": 0.5}})
        model, pruner, optimizer = ns["model"], ns["pruner"], ns["optimizer"]
        assert all(isinstance(p, DTensor) for p in model.parameters())
        attention = ns["small"].model.layers[0].self_attn
        assert attention.q_proj.out_features == 16  # half of 4 heads of 8
        assert not any(isinstance(p, DTensor) for p in ns["small"].parameters())
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        assert int(pruner.state.steps) == 1
        assert pruner.scores.grad is not None  # in the optimizer's scores group
        with pytest.raises(ValueError, match=r"export\(\) copies the model whole"):
            pruner.export()
    finally:
        dist.destroy_process_group()


def pretokenize(tmp_path, monkeypatch):
    """docs/pipeline.md: token ids written with the model's tokenizer to train.npy and
    val.npy, read back by data.tokenizer: pretokenized as those tokens in blocks."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dtp_kernels.pipeline import recipe
    from dtp_kernels.pipeline.run import build_data

    texts = {"train": ["a b c a b", "c c b a " * 40], "val": ["b a c " * 30, "a a"]}
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model_dir = tmp_path / "model"
    tiny_llama(vocab=len(vocab)).save_pretrained(model_dir)
    transformers.PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(model_dir)
    (tmp_path / "text").mkdir()
    names = {"model_dir": str(model_dir), "text_dir": str(tmp_path / "text")}
    run(("pipeline.md", 0), {**names, "train_texts": texts["train"], "val_texts": texts["val"]})
    settings = recipe.load(
        DOCS.parent / "dtp_kernels" / "configs" / "causal_lm.yaml",
        [
            f"model.path={model_dir}",
            f"data.root={tmp_path / 'text'}",
            "data.seq_len=8",
            "data.tokenizer=pretokenized",
        ],
    )
    _, test = build_data(settings, vocab_size=len(vocab))
    words = " ".join(texts["val"]).split()
    assert test.dataset[0][0].tolist() == [vocab[w] for w in words[:8]]
    assert test.dataset[0][1].tolist() == [vocab[w] for w in words[1:9]]


ENTRIES = {
    ("pipeline.md", 0): pretokenize,
    ("ops.md", 0): ops_loop,
    ("pruning.md", 0): pruner_loop,
    ("pruning.md", 1): prepare_llama,
    ("pruning.md", 2): fsdp_llama,
    ("pruning.md", 3): prepare_gpt2,
    ("pruning.md", 4): trainer_callback,
}


@pytest.mark.parametrize("key", list(ENTRIES), ids=[f"{f}-{i}" for f, i in ENTRIES])
def test_docs_block_runs(key, tmp_path, monkeypatch):
    pytest.importorskip("transformers")  # two blocks use it; tiny_llama imports it
    ENTRIES[key](tmp_path, monkeypatch)
