"""Weights several modules hold (shared_weights.py), on transformers' Zamba2 (tiny
configurations built here, nothing downloaded), whose hybrid layers each hold the shared
transformer block as a module of their own with the same tensors: the attention heads of
the layers sharing a block are one group, exported with one tensor per weight again,
equal to the hard-masked model, with the parameters predicted; a group that would cut a
shared weight apart (the block's MLP) is refused by name; an export whose holders of one
weight were cut apart is refused."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, load_pruned, save_pruned
from dtp_kernels.pruning.groups import ChannelGraphError
from dtp_kernels.pruning.shared_weights import UntiedExportError, holders, tie_again
from dtp_kernels.pruning.tied_heads import TiedHeadGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import causal_lm, hard_masked_and_exported, randomised

transformers = pytest.importorskip("transformers")

# 4 layers, 3 of them hybrid, all sharing one block (num_mem_blocks=1); 4 heads of 8
ZAMBA2 = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_hidden_layers=4,
    layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"],
    mamba_headdim=8,
    mamba_ngroups=2,
    mamba_d_state=8,
    n_mamba_heads=8,
    chunk_size=8,
    attention_head_dim=8,
    num_mem_blocks=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=32,
)
SHARED = "model.layers.{}.shared_transformer"


def zamba2() -> nn.Module:
    """The tiny Zamba2 (save_pruned's builder "test_shared_weights:zamba2")."""
    return causal_lm("Zamba2", ZAMBA2)


def tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def attention(model: nn.Module, layer: int) -> nn.Module:
    return model.get_submodule(SHARED.format(layer) + ".self_attn")


def test_the_model_holds_one_block_in_three_modules():
    """The premise: the hybrid layers' blocks are separate modules holding one tensor."""
    model = zamba2()
    blocks = [attention(model, layer) for layer in (0, 2, 3)]
    assert blocks[0] is not blocks[1]
    assert all(b.q_proj.weight is blocks[0].q_proj.weight for b in blocks)


def test_the_heads_of_a_shared_block_are_one_group_exported_tied():
    """One group for the three layers' heads (not three cutting one tensor three ways);
    the export removes the same heads from each, holds one tensor per weight again,
    computes what the hard-masked model does and has the parameters predicted."""
    model, ids = zamba2(), tokens()
    pruner = randomised(DTPPruner(model, (ids,), {"heads": 0.5, "mamba": 0.5}))
    heads = [g for g in pruner.groups if isinstance(g, TiedHeadGroup)]
    assert [g.name for g in heads] == [SHARED.format(0) + ".self_attn"]
    assert [m.name for m in heads[0].members] == [
        SHARED.format(layer) + ".self_attn" for layer in (0, 2, 3)
    ]
    exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    blocks = [attention(exported, layer) for layer in (0, 2, 3)]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weights = [getattr(b, name).weight for b in blocks]
        assert all(w is weights[0] for w in weights), name
    assert blocks[0].q_proj.out_features == attention(model, 0).q_proj.out_features // 2
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert pruner.report()["params_after"] == params


def test_a_saved_export_loads_tied(tmp_path):
    """save_pruned with a builder, then load_pruned: the same outputs, one tensor per
    weight of the shared block."""
    model, ids = zamba2(), tokens()
    exported = randomised(DTPPruner(model, (ids,), {"heads": 0.5})).export().eval()
    path = tmp_path / "zamba2.safetensors"
    save_pruned(path, exported, builder="test_shared_weights:zamba2")
    loaded = load_pruned(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, exported(ids).logits, rtol=0, atol=0)
    assert attention(loaded, 3).q_proj.weight is attention(loaded, 0).q_proj.weight


def test_a_group_cutting_a_shared_weight_apart_is_refused_by_name():
    """The block's MLP is a group of channels per layer: each would cut the tensors the
    others hold too, so a float ratio is refused naming them, with the ratios that leave
    them whole, which then prune the rest."""
    model, ids = zamba2(), tokens()
    with pytest.raises(ValueError, match="weights other modules hold too") as refused:
        DTPPruner(model, (ids,), 0.5)
    message = str(refused.value)
    for layer in (0, 2, 3):
        assert f"{SHARED.format(layer)}.feed_forward" in message
    ratios = eval(message.rsplit("ratios=", 1)[1])  # the refusal's advice, as a user takes it
    pruner = randomised(DTPPruner(model, (ids,), ratios))
    exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


# Zamba: 2 hybrid layers sharing one block, whose MLP is found by its form (Torch-Pruning's
# graph fails on Zamba's multi-head Mamba mixer)
ZAMBA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_hidden_layers=3,
    layers_block_type=["mamba", "hybrid", "hybrid"],
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=32,
    n_mamba_heads=2,
    mamba_d_state=8,
    mamba_dt_rank=4,
)


def test_an_mlp_found_by_its_form_on_shared_weights_is_refused_and_the_heads_prune():
    """A float ratio is refused, Torch-Pruning's graph failing on the model, with the
    ratios of the kinds found without it; given them, Zamba's block MLP, found by its
    form in each hybrid layer, would cut the tensors the other layer holds: refused
    naming both layers' MLPs; its heads, one group, prune and export tied, equal to the
    hard-masked model, with the parameters predicted."""
    model, ids = causal_lm("Zamba", ZAMBA), tokens()
    with pytest.raises(ChannelGraphError, match="found without it") as failed:
        DTPPruner(model, (ids,), 0.5)
    ratios = eval(str(failed.value).rsplit("ratios=", 1)[1])  # as a user takes the advice
    assert ratios == {"heads": 0.5, "mlp": 0.5}
    with pytest.raises(ValueError, match="weights other modules hold too") as refused:
        DTPPruner(model, (ids,), ratios)
    for layer in (1, 2):
        assert f"model.layers.{layer}.shared_transf.feed_forward.gate_proj" in str(refused.value)
    pruner = randomised(DTPPruner(model, (ids,), {"heads": 0.5}))
    assert [g.name for g in pruner.groups] == ["model.layers.1.shared_transf.self_attn"]
    exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    blocks = [exported.get_submodule(f"model.layers.{i}.shared_transf.self_attn") for i in (1, 2)]
    assert blocks[0].o_proj.weight is blocks[1].o_proj.weight
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_a_failed_search_names_its_layers_not_the_kinds(monkeypatch):
    """Only a graph that cannot be built at all gives the kinds' ratios: a search that
    fails for one layer names that layer to leave whole (the advice that prunes most)."""
    from dtp_kernels.pruning import groups

    search = groups.coupled_group
    model, ids = zamba2(), tokens()
    failing = model.get_submodule(SHARED.format(0) + ".feed_forward.down_proj")

    def fails_at_one_layer(graph, module, handler, idxs):
        if module is failing:
            raise IndexError("list index out of range")
        return search(graph, module, handler, idxs)

    monkeypatch.setattr(groups, "coupled_group", fails_at_one_layer)
    named = "'model.layers.0.shared_transformer.feed_forward.down_proj' fails"
    with pytest.raises(ChannelGraphError, match=named) as failed:
        DTPPruner(model, (ids,), 0.5)
    assert "found without it" not in str(failed.value)


def test_an_export_with_one_weight_cut_apart_is_refused():
    """tie_again refuses a copy whose holders of one tensor differ (one cut, one not),
    and ties holders whose cut tensors are equal."""
    layer = nn.Linear(4, 4)
    model = nn.Sequential(layer, layer.__class__(4, 4))
    model[1].weight = layer.weight
    copy = nn.Sequential(nn.Linear(4, 3), nn.Linear(4, 4))
    with pytest.raises(UntiedExportError, match="cut apart"):
        tie_again(holders(model), copy)
    equal = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        equal[1].weight.copy_(equal[0].weight)
    tie_again(holders(model), equal)
    assert equal[1].weight is equal[0].weight
