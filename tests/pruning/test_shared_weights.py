"""Weights several modules hold (shared_weights.py), on transformers' Zamba2 and Zamba
(tiny configurations built here, nothing downloaded), whose hybrid layers each hold the
shared transformer block as a module of their own with the same tensors: the attention
heads of the layers sharing a block are one group, the MLP's groups in each layer take
one mask, and the export holds one tensor per weight again, equal to the hard-masked
model, with the parameters and FLOPs predicted; groups of one tensor given different
ratios are refused together; an export whose holders of one weight were cut apart is
refused."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, load_pruned, save_pruned
from dtp_kernels.pruning.channel_graph import ChannelGraphError
from dtp_kernels.pruning.cost import count_flops
from dtp_kernels.pruning.shared_weights import UntiedExportError, holders, tie_again
from dtp_kernels.pruning.tied_heads import TiedHeadGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import causal_lm, hard_masked_and_exported, layer_shapes, randomised, whole_as_listed

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


def test_the_shared_blocks_groups_of_channels_take_one_mask_and_export_tied():
    """The block's output width (its MLP's down_proj rows, read by each hybrid layer's
    own `linear`) is a group of channels in each layer, all cutting one tensor: they
    take the first's mask. A float ratio prunes them with the heads, the mixers and the
    rank of the adapter each layer runs; the export equals the hard-masked model, holds
    the block's tensors one per weight again, hands the adapter a layer's group cut to
    the holders that never run it (not listed as left whole), and has the parameters and
    FLOPs predicted."""
    model, ids = zamba2(), tokens()
    shapes = layer_shapes(model)
    pruner = randomised(DTPPruner(model, (ids,), 0.5))
    names = [g.name for g in pruner.groups]
    width = [names.index(SHARED.format(layer) + ".feed_forward.down_proj") for layer in (0, 2, 3)]
    assert [pruner.mask_of[i] for i in width] == [width[0]] * 3
    masks = pruner.hard_masks()
    assert all(torch.equal(masks[i], masks[width[0]]) for i in width)
    exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mlps = [exported.get_submodule(SHARED.format(layer) + ".feed_forward") for layer in (0, 2, 3)]
    assert all(m.down_proj.weight is mlps[0].down_proj.weight for m in mlps)
    assert mlps[0].down_proj.weight.shape == (16, 32)
    for layer in (0, 2, 3):  # each layer's own reader of the block's output
        assert exported.get_submodule(f"model.layers.{layer}.linear").in_features == 16
    # the adapter the second hybrid layer runs, cut by its group, held by the first too
    adapters = [m.gate_up_proj_adapter_list[1] for m in mlps]
    assert adapters[0][0].weight is adapters[1][0].weight
    assert adapters[0][0].out_features == adapters[1][0].weight.shape[0] == 64
    assert whole_as_listed(exported, shapes, pruner.left_whole)  # the idle holders: cut
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, (ids,))


def test_a_tie_sets_later_groups_learn_through_the_first_ones_mask():
    """In training, the later groups of a set read the first one's soft mask: the loss
    reaches its scores alone, none of theirs."""
    model, ids = zamba2(), tokens()
    pruner = randomised(DTPPruner(model.train(), (ids,), 0.5))
    model(ids, labels=ids).loss.backward()
    grads = pruner.scores.grad.split(pruner.sizes)
    for index, source in enumerate(pruner.mask_of):
        assert bool(grads[index].any()) == (source == index), pruner.groups[index].name


def test_the_report_names_the_mask_each_group_reads_and_reports_that_masks_figures():
    """report() says which group's mask each group reads (its own, or its set's first),
    and a later group of a set reports the figures of that mask (its k, the soft mask's
    mass in its top k, its distance to the hard one, its skipped steps), not of the
    untrained scores it never reads."""
    model, ids = zamba2(), tokens()
    pruner = randomised(DTPPruner(model.train(), (ids,), 0.5))
    optimizer = torch.optim.SGD(pruner.parameters(), lr=1.0)
    pruner.attach(optimizer)
    for _ in range(3):  # the first group's soft mask moves; the later ones' scores do not
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    rows = pruner.report()["groups"]
    figures = ("k", "mass_in_top_k", "distance_to_hard", "skipped_steps")
    followers = [i for i, source in enumerate(pruner.mask_of) if source != i]
    assert followers
    for index, (row, source) in enumerate(zip(rows, pruner.mask_of, strict=True)):
        assert row["mask_of"] == pruner.groups[source].name, row
        assert {f: row[f] for f in figures} == {f: rows[source][f] for f in figures}, index
    soft = pruner._transport(update=False).detach().float().split(pruner.sizes)
    own = soft[followers[0]]  # what the follower's own scores would have reported
    assert not torch.equal(own, soft[pruner.mask_of[followers[0]]])


def test_a_shared_tensor_one_holder_of_which_stays_whole_is_refused():
    """A layer that runs the block's MLP uncut (left whole by ignored_layers, so its
    group is none) holds the tensors the other layer's group cuts: that group is refused
    by name; a member of a set refused for a reason of its own takes its set with it."""
    from dtp_kernels.pruning import refusals

    model, ids = causal_lm("Zamba", ZAMBA), tokens()
    whole = model.get_submodule("model.layers.2.shared_transf.feed_forward.gate_proj")
    with pytest.raises(ValueError, match="hold too and run") as refused:
        DTPPruner(model, (ids,), {"mlp": 0.5}, ignored_layers=[whole])
    assert "'model.layers.1.shared_transf.feed_forward.gate_proj' cuts" in str(refused.value)
    model, ids = zamba2(), tokens()
    groups = [SHARED.format(layer) + ".feed_forward.down_proj" for layer in (0, 2, 3)]
    real = refusals.enclosing_reader_refusals

    def refusing_the_middle_one(model, groups_, inputs):
        return {**real(model, groups_, inputs), groups[1]: ["a reader outside it"]}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(refusals, "enclosing_reader_refusals", refusing_the_middle_one)
        with pytest.raises(ValueError, match="a reader outside it") as refused:
            DTPPruner(model, (ids,), 0.5)
    ratios = eval(str(refused.value).rsplit("ratios=", 1)[1])
    assert all(ratios[name] == 0 for name in groups)


def test_groups_cutting_one_tensor_with_other_ratios_are_refused_together():
    """One group of the set given a ratio of its own, or a global budget, would cut
    the tensor its tie set shares apart: refused naming the set, with the ratios that
    leave all of it whole, which then prune the rest."""
    model, ids = zamba2(), tokens()
    first = SHARED.format(0) + ".feed_forward.down_proj"
    with pytest.raises(ValueError, match="cannot prune these groups apart") as refused:
        DTPPruner(model, (ids,), {"*": 0.5, first: 0.25})
    ratios = eval(str(refused.value).rsplit("ratios=", 1)[1])  # as a user takes the advice
    assert all(ratios[SHARED.format(layer) + ".feed_forward.down_proj"] == 0 for layer in (0, 2, 3))
    pruner = randomised(DTPPruner(model, (ids,), ratios))
    _, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one ratio under budget='layer'"):  # (no mixers:
        DTPPruner(causal_lm("Zamba", ZAMBA), (ids,), {"mlp": 0.5}, budget="global")  # theirs)


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


def test_a_graphless_model_prunes_its_shared_blocks_heads_and_mlp_tied():
    """Torch-Pruning's graph cannot be built on Zamba: a float ratio is refused with the
    ratios of the kinds found without it; given them, the shared block's heads (one
    group) and its MLP found by its form in each hybrid layer (one mask) prune, exported
    equal to the hard-masked model with one tensor per weight, the parameters predicted."""
    model, ids = causal_lm("Zamba", ZAMBA), tokens()
    with pytest.raises(ChannelGraphError, match="found without it") as failed:
        DTPPruner(model, (ids,), 0.5)
    ratios = eval(str(failed.value).rsplit("ratios=", 1)[1])  # as a user takes the advice
    assert ratios == {"heads": 0.5, "mlp": 0.5}
    pruner = randomised(DTPPruner(model, (ids,), ratios))
    names = [g.name for g in pruner.groups]
    block = "model.layers.{}.shared_transf"
    assert names == [
        block.format(1) + ".self_attn",
        block.format(1) + ".feed_forward.gate_proj",
        block.format(2) + ".feed_forward.gate_proj",
    ]
    assert pruner.mask_of == [0, 1, 1]
    exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    blocks = [exported.get_submodule(block.format(i)) for i in (1, 2)]
    assert blocks[0].self_attn.o_proj.weight is blocks[1].self_attn.o_proj.weight
    assert blocks[0].feed_forward.up_proj.weight is blocks[1].feed_forward.up_proj.weight
    assert blocks[0].feed_forward.up_proj.out_features == 16
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_a_failed_search_names_its_layers_not_the_kinds(monkeypatch):
    """Only a graph that cannot be built at all gives the kinds' ratios: a search that
    fails for one layer names that layer to leave whole (the advice that prunes most)."""
    from dtp_kernels.pruning import channel_graph

    search = channel_graph.coupled_group
    model, ids = zamba2(), tokens()
    failing = model.get_submodule(SHARED.format(0) + ".feed_forward.down_proj")

    def fails_at_one_layer(graph, module, handler, idxs):
        if module is failing:
            raise IndexError("list index out of range")
        return search(graph, module, handler, idxs)

    monkeypatch.setattr(channel_graph, "coupled_group", fails_at_one_layer)
    named = "'model.layers.0.shared_transformer.feed_forward.down_proj' fails"
    with pytest.raises(ChannelGraphError, match=named) as failed:
        DTPPruner(model, (ids,), 0.5)
    assert "found without it" not in str(failed.value)


class RowsAndColumns(nn.Module):
    """One 8 x 8 tensor held by `d` and by `e`: the groups rooted at `d` and at `e` cut
    its rows, the one rooted at `g` (which `e` reads) its columns."""

    def __init__(self) -> None:
        super().__init__()
        self.d, self.f1 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.g, self.e, self.f2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.e.weight = self.d.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f1(torch.relu(self.d(x))) + self.f2(torch.relu(self.e(torch.relu(self.g(x)))))


def test_groups_cutting_one_tensor_as_rows_and_as_columns_are_refused():
    """Two groups cutting one tensor, one by its rows and one by its columns, or of other
    sizes, cannot share a mask: refused as a set before any mask, not at export."""
    torch.manual_seed(0)
    model = RowsAndColumns()
    with pytest.raises(ValueError, match="cut the tensor alike") as refused:
        DTPPruner(model, (torch.randn(2, 8),), 0.5)
    assert "['d', 'g', 'e']" in str(refused.value)
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())


class TwoHoldersOfOneMLP(nn.Module):
    """A three-layer MLP held twice, as modules of their own with the same tensors (a
    detector's box head its decoder holds too), run on two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.first.append(nn.Linear(8, 4))
        self.second = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.second.append(nn.Linear(8, 4))
        for a, b in zip(self.first, self.second, strict=True):
            for name, parameter in a.named_parameters():
                setattr(b, name, parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(2 * x)


def test_both_layers_of_an_mlp_held_twice_are_one_set_cut_alike_in_each_holder():
    """Each holder's middle layer loses its rows to one group and its columns to the
    other: the four groups are one set, each holder cut alike, so a float prunes it,
    exported equal to the hard-masked model, tied, with the parameters predicted."""
    torch.manual_seed(0)
    model, x = TwoHoldersOfOneMLP(), torch.randn(3, 8)
    pruner = randomised(DTPPruner(model, (x,), 0.5))
    assert [g.name for g in pruner.groups] == ["first.0", "first.2", "second.0", "second.2"]
    assert pruner.mask_of == [0, 0, 0, 0]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export()
    torch.testing.assert_close(exported(x), want, rtol=1e-6, atol=1e-6)
    assert exported.first[2].weight is exported.second[2].weight
    assert exported.first[2].weight.shape == (4, 4)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


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
