"""KV sharing (dtp_kernels/pruning/shared_kv.py): Gemma 3n's and Gemma 4's last layers
read the keys and values an earlier layer of their type stores, so the store layer and
its readers lose the same key/value heads, with their query heads, together."""

from __future__ import annotations

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.shared_kv import SharedKVGroup
from utils import described_export, randomised

transformers = pytest.importorskip("transformers")

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny(family: str):
    """4 layers of 4 query heads of 16 over 2 key/value heads; the last 2 read the keys
    and values of the first 2 (one of each type)."""
    sizes = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=TYPES,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=16,
        sliding_window=8,
    )
    if family == "gemma3n":
        config = transformers.Gemma3nTextConfig(
            **sizes, laurel_rank=8, activation_sparsity_pattern=[0.0] * 4
        )
        build = transformers.Gemma3nForCausalLM
    else:
        config = transformers.Gemma4TextConfig(**sizes, global_head_dim=16)
        build = transformers.Gemma4ForCausalLM
    torch.manual_seed(0)
    return build(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
def test_a_store_layer_and_its_readers_lose_the_same_heads(family):
    """Each store layer is one group with the layer reading its keys and values: the
    mask's kept key/value heads keep their query rows and output columns in both, the
    readers get no group of their own, and the export computes what the hard-masked
    model computes, with the parameters the report predicts and a config that
    rebuilds it."""
    model, inputs = tiny(family), (tokens(),)
    layers = model.model.layers
    dense = {i: layers[i].self_attn.q_proj.weight.detach().clone() for i in range(4)}
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    heads = [g for g in pruner.groups if isinstance(g, SharedKVGroup)]
    assert [[m.name for m in g.members] for g in heads] == [
        ["model.layers.0.self_attn", "model.layers.2.self_attn"],
        ["model.layers.1.self_attn", "model.layers.3.self_attn"],
    ]
    masks = dict(zip([g.name for g in pruner.groups], pruner.hard_masks(), strict=True))
    exported, _ = described_export(pruner, model, inputs)
    for store, reader in ((0, 2), (1, 3)):
        (unit,) = masks[f"model.layers.{store}.self_attn"].nonzero().flatten().tolist()
        rows = torch.arange(unit * 32, unit * 32 + 32)  # its 2 query heads of 16
        for i in (store, reader):
            cut = exported.model.layers[i].self_attn.q_proj.weight
            torch.testing.assert_close(cut, dense[i][rows], rtol=0, atol=0)
    assert pruner.predicted_counts()[0] == sum(p.numel() for p in exported.parameters())
    assert (exported.config.num_attention_heads, exported.config.num_key_value_heads) == (2, 1)


def test_a_reader_stays_whole_with_its_store_layer():
    """A store layer left whole (a ratio of 0) leaves its reader whole too: the reader
    has no group to prune, and the others still prune exactly."""
    model, inputs = tiny("gemma3n"), (tokens(),)
    ratios = {"heads": 0.5, "model.layers.0.self_attn": 0}
    pruner = randomised(DTPPruner(model, inputs, ratios))
    with pytest.warns(UserWarning, match="config cannot describe"):  # layers differ
        exported = pruner.export()
    widths = [layer.self_attn.q_proj.out_features for layer in exported.model.layers]
    assert widths == [64, 32, 64, 32]
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(*inputs).logits
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(*inputs).logits, want, rtol=1e-5, atol=1e-5)


def test_a_reader_of_a_layer_not_pruned_with_it_is_refused_by_name():
    """A reader whose store layer is ignored (no group) cannot lose heads: asking for
    them is an error naming it, before anything changes."""
    model, inputs = tiny("gemma3n"), (tokens(),)
    store = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"'model.layers.2.self_attn': it reads the keys"):
        DTPPruner(model, inputs, {"heads": 0.5}, ignored_layers=[store])
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
