"""KV sharing (dtp_kernels/pruning/shared_kv.py): Gemma 3n's and Gemma 4's last layers
read the keys and values an earlier layer of their type stores, so the store layer and
its readers lose the same key/value heads, with their query heads, together."""

from __future__ import annotations

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.shared_kv import SharedKVGroup
from utils import described_export, randomised, tiny_gemma_sharing_kv

transformers = pytest.importorskip("transformers")


def tokens() -> torch.Tensor:
    return torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
def test_a_store_layer_and_its_readers_lose_the_same_heads(family):
    """Each store layer is one group with the layer reading its keys and values: the
    mask's kept key/value heads keep their query rows and output columns in both, the
    readers get no group of their own, and the export computes what the hard-masked
    model computes, with the parameters the report predicts and a config that
    rebuilds it."""
    model, inputs = tiny_gemma_sharing_kv(family), (tokens(),)
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
    model, inputs = tiny_gemma_sharing_kv("gemma3n"), (tokens(),)
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
    model, inputs = tiny_gemma_sharing_kv("gemma3n"), (tokens(),)
    store = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"'model.layers.2.self_attn': it reads the keys"):
        DTPPruner(model, inputs, {"heads": 0.5}, ignored_layers=[store])
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
