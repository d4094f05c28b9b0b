"""Attention heads tied across a stack by the bias per head its first layer computes (T5
and the families built on its attention; tiny configurations built here): each chain
of layers is one group, the same heads leave every layer of it and the first layer's
tables, and the export computes what the hard-masked model computes, generates as it
does and, with one count for all, loads from its saved config."""

import warnings

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops
from dtp_kernels.pruning.tied_heads import TiedHeadGroup
from utils import hard_masked_and_exported, randomised, tiny_t5

transformers = pytest.importorskip("transformers")

# family: the model, and its chains' layer names (encoder self-attention, decoder self-
# and cross-attention), the first first
STACKS = (
    "encoder.block.{}.layer.0.{}",
    "decoder.block.{}.layer.0.SelfAttention",
    "decoder.block.{}.layer.1.EncDecAttention",
)
FAMILIES = {
    "t5": (lambda: tiny_t5(), "SelfAttention"),
    "mt5": (lambda: tiny_t5("MT5"), "SelfAttention"),
    # 32 heads and 32 buckets: the bias table is (32, 32), its heads on dimension 1
    "t5_heads_as_many_as_buckets": (lambda: tiny_t5(num_heads=32, d_kv=2), "SelfAttention"),
    # the encoder's local attention: a bias per block, its heads on dimension 2
    "longt5_local": (
        lambda: tiny_t5("LongT5", encoder_attention_type="local", local_radius=2),
        "LocalSelfAttention",
    ),
    # and global tokens: a second table, and a norm of the global tokens (the model
    # width, as the query width here) that is not over the heads
    "longt5_transient_global": (
        lambda: tiny_t5(
            "LongT5",
            encoder_attention_type="transient-global",
            local_radius=2,
            global_block_size=2,
        ),
        "TransientGlobalSelfAttention",
    ),
    "switch_transformers": (
        lambda: tiny_t5(
            "SwitchTransformers",
            num_decoder_layers=2,
            num_experts=4,
            num_sparse_encoder_layers=1,
            num_sparse_decoder_layers=1,
            expert_capacity=8,
        ),
        "SelfAttention",
    ),
    "pop2piano": (lambda: tiny_t5("Pop2Piano"), "SelfAttention"),
}


def modules_by_name(exported, model):
    return dict(exported.named_modules()), {m: n for n, m in model.named_modules()}


def test_each_chain_of_a_stack_is_one_group_named_after_its_first_layer():
    model, inputs = tiny_t5()
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    tied = [g for g in pruner.groups if isinstance(g, TiedHeadGroup)]
    names = [[m.name for m in g.tied] for g in tied]
    assert names == [[stack.format(i, "SelfAttention") for i in (0, 1)] for stack in STACKS]
    assert [g.name for g in tied] == [chain[0] for chain in names]
    assert [g.size for g in tied] == [4, 4, 4]
    first = model.encoder.block[0].layer[0].SelfAttention
    assert tied[0].tables == [(first.relative_attention_bias, "weight", 1)]
    assert tied[2].tables == []  # the cross-attention's bias is zeros: no table
    # scores start at each unit's filter norm: its output columns in every layer
    originals = [m.layer.parametrizations.weight.original for m in tied[0].tied]
    columns = [w.detach().view(32, 4, 8) for w in originals]
    norms = torch.stack([c.square().sum((0, 2)) for c in columns]).sum(0).sqrt()
    torch.testing.assert_close(pruner.scores.detach()[:4], norms)
    # one mask on every layer's output columns
    for group in tied:
        for member in group.tied:
            assert torch.nn.utils.parametrize.is_parametrized(member.layer, "weight")
    with torch.no_grad(), pruner.hard_masked():
        masks = [member.layer.weight.ne(0).any(0) for member in tied[1].tied]
    assert torch.equal(masks[0], masks[1]) and int(masks[0].sum()) == 2 * 8


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_heads_export_the_same_heads_from_every_layer_equal_to_the_masked_model(
    family, tmp_path
):
    build, encoder_attention = FAMILIES[family]
    model, inputs = build()
    # Switch Transformers: an expert no example token reaches stays whole, which its
    # config cannot describe; its MLPs stay whole here
    mlp = 0 if family == "switch_transformers" else 0.5
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5, "mlp": mlp}))
    tied = [g for g in pruner.groups if isinstance(g, TiedHeadGroup)]
    assert [g.name for g in tied] == [s.format(0, encoder_attention) for s in STACKS]
    masks = {g.name: m for g, m in zip(pruner.groups, pruner.hard_masks(), strict=True)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not [w for w in caught if "config cannot describe" in str(w.message)]
    modules, names = modules_by_name(exported, model)
    for group in tied:
        kept = masks[group.name].nonzero().flatten()
        heads = group.units // 2
        assert len(kept) == heads
        for member in group.tied:
            original, cut = member.module, modules[member.name]
            assert cut.n_heads == heads and cut.inner_dim == heads * group.head_dim
            for name in ("q", "k", "v"):  # the very heads kept: their rows, in order
                rows = (kept[:, None] * group.head_dim + torch.arange(group.head_dim)).flatten()
                torch.testing.assert_close(
                    getattr(cut, name).weight, getattr(original, name).weight[rows]
                )
            assert cut.o.in_features == heads * group.head_dim
        for owner, name, dim in group.tables:  # the first layer's tables
            table = getattr(modules[names[owner]], name)
            assert table.shape[dim] == heads
            torch.testing.assert_close(table, getattr(owner, name).index_select(dim, kept))
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs)
    if family != "pop2piano":  # the cached decoder path too (Pop2Piano's needs a composer)
        with torch.no_grad(), pruner.hard_masked():
            want = model.generate(inputs[0], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        got = exported.generate(inputs[0], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert torch.equal(got, want)
    exported.save_pretrained(tmp_path)  # one head count for all: the config describes it
    loaded = type(exported).from_pretrained(tmp_path).eval()
    assert loaded.config.num_heads == tied[0].units // 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, exported(*inputs).logits)


def test_a_float_and_a_global_budget_prune_the_tied_heads_with_the_rest():
    model, inputs = tiny_t5()
    for options in ({}, {"budget": "global"}):
        pruner = randomised(DTPPruner(model, inputs, 0.5, **options))
        kinds = {type(g).__name__ for g in pruner.groups}
        assert kinds == {"TiedHeadGroup", "ChannelGroup"}
        _, got, want = hard_masked_and_exported(pruner, model, inputs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert sum(pruner.kept_counts()) < sum(pruner.sizes)
        pruner.remove()


def test_a_ratio_for_a_later_layer_of_a_chain_names_the_first_layer():
    model, inputs = tiny_t5()
    later = "decoder.block.1.layer.0.SelfAttention"
    with pytest.raises(ValueError, match=r"tied to those of 'decoder.block.0.layer.0.Self"):
        DTPPruner(model, inputs, {later: 0.5})
    pruner = DTPPruner(model, inputs, {"decoder.block.0.layer.0.SelfAttention": 0.5})
    assert [m.name for m in pruner.groups[0].tied][1] == later


def test_a_later_layer_that_adds_other_heads_bias_is_refused_naming_it():
    """A layer of a chain that adds the bias of other heads than its own (here: the bias
    handed to it reversed over the heads) would not keep its heads' biases when the
    first layer loses heads: its proof, on the bias cut as export cuts it, fails, and
    the chain is refused naming that layer; the model is left untouched."""
    model, inputs = tiny_t5()
    later = model.decoder.block[1].layer[0].SelfAttention

    class Reversed(type(later)):
        def forward(self, *args, position_bias=None, **kwargs):
            return super().forward(*args, position_bias=position_bias.flip(1), **kwargs)

    later.__class__ = Reversed
    with pytest.raises(ValueError, match=r"its tied layer 'decoder.block.1.layer.0.SelfAtt"):
        DTPPruner(model, inputs, {"heads": 0.5})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    pruner = DTPPruner(model, inputs, {"encoder.block.0.layer.0.SelfAttention": 0.5})
    _, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class BiasedAttention(torch.nn.Module):
    """T5's form of attention (q, k, v, o, key_value_proj_dim) adding a bias per head
    that the first layer computes from its table and the others are handed; a layer of
    fewer heads adds the first ones' bias."""

    def __init__(self, heads: int, first: bool) -> None:
        super().__init__()
        self.n_heads, self.key_value_proj_dim = heads, 8
        width = heads * 8
        self.q, self.k, self.v = (torch.nn.Linear(16, width) for _ in range(3))
        self.o = torch.nn.Linear(width, 16)
        self.relative_attention_bias = torch.nn.Embedding(5, heads) if first else None

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor | None = None):
        batch, length, _ = x.shape
        q, k, v = (
            p(x).view(batch, length, -1, 8).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        if position_bias is None:
            where = torch.arange(length)
            buckets = (where[None] - where[:, None]).clamp(-2, 2) + 2
            position_bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None]
        scores = q @ k.transpose(-1, -2) + position_bias[:, : q.shape[1]]
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
        return self.o(out), position_bias


class BiasedStack(torch.nn.Module):
    def __init__(self, heads: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(BiasedAttention(h, i == 0) for i, h in enumerate(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None
        for layer in self.layers:
            out, bias = layer(x, position_bias=bias)
            x = x + out
        return x


def test_the_chain_is_found_by_the_bias_tensor_handed_on_in_any_model():
    torch.manual_seed(0)
    model, inputs = BiasedStack([4, 4, 4]), (torch.randn(2, 6, 16),)
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    (group,) = pruner.groups
    assert [m.name for m in group.tied] == ["layers.0", "layers.1", "layers.2"]
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(*inputs)
    exported = pruner.export()
    torch.testing.assert_close(exported(*inputs), want, rtol=1e-5, atol=1e-5)
    assert exported.layers[0].relative_attention_bias.weight.shape == (5, 2)


def test_a_later_layer_with_other_heads_than_the_first_is_refused_by_name():
    """A later layer of a chain with fewer heads than the first (it adds the first ones'
    bias) cannot lose the first layer's heads: refused, saying whose bias it adds."""
    torch.manual_seed(0)
    model, inputs = BiasedStack([4, 2]), (torch.randn(2, 6, 16),)
    with pytest.raises(ValueError, match=r"'layers.1': it adds the bias 'layers.0' computes"):
        DTPPruner(model, inputs, {"heads": 0.5})


def test_a_chain_whose_bias_reaches_a_layer_left_whole_is_refused_naming_it():
    """A later layer of a chain left whole (ignored_layers) would be handed the first
    layer's bias cut to fewer heads: the chain is refused, naming that layer."""
    model, inputs = tiny_t5()
    left = model.decoder.block[1].layer[0].SelfAttention
    with pytest.raises(ValueError, match=r"handed to 'decoder.block.1.layer.0.SelfAttention' too"):
        DTPPruner(model, inputs, {"heads": 0.5}, ignored_layers=[left])
    with pytest.raises(ValueError, match=r"handed to 'decoder.block.1.layer.0.SelfAttention' too"):
        DTPPruner(model, inputs, {"heads": 0.5}, ignored_layers=[left.o])
    pruner = DTPPruner(
        model, inputs, {"heads": 0.5, "decoder.block.0.layer.0.*": 0}, ignored_layers=[left]
    )
    tied = [g.name for g in pruner.groups]  # the encoder's chain and the cross-attention's
    assert tied == [s.format(0, "SelfAttention") for s in STACKS[::2]]


def exported_as_masked(pruner, model, inputs: tuple):
    """The export of a model of one tied group, checked equal to the hard-masked model,
    and the units that group keeps."""
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(*inputs)
    exported = pruner.export()
    torch.testing.assert_close(exported(*inputs), want, rtol=1e-5, atol=1e-5)
    return exported, pruner.hard_masks()[0].nonzero().flatten()


class TableBiasedStack(torch.nn.Module):
    """Layers of BiasedAttention handed a bias per head that the model computes, from a
    table of its own (`from_table`, as MPNet's encoder does) or from a buffer beside an
    embedding of as many columns that does not give it."""

    def __init__(self, layers: int = 3, from_table: bool = True) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(BiasedAttention(4, False) for _ in range(layers))
        self.relative_attention_bias = torch.nn.Embedding(5, 4)
        self.from_table = from_table
        self.register_buffer("fixed", torch.randn(1, 4, 6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = torch.arange(x.shape[1])
        buckets = (where[None] - where[:, None]).clamp(-2, 2) + 2
        table = self.relative_attention_bias(buckets).permute(2, 0, 1)[None].contiguous()
        bias = table if self.from_table else self.fixed + table.sum()
        for layer in self.layers:
            out, _ = layer(x, position_bias=bias)
            x = x + out
        return x


def test_layers_handed_a_bias_the_model_computes_from_a_table_are_tied_with_it():
    """A bias per head the model computes from a table of one column per head (MPNet's)
    ties the layers it is handed to, with that table: the same heads leave every layer
    and the table's columns; the export computes what the hard-masked model computes."""
    torch.manual_seed(0)
    model, inputs = TableBiasedStack(), (torch.randn(2, 6, 16),)
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    (group,) = pruner.groups
    assert [m.name for m in group.tied] == ["layers.0", "layers.1", "layers.2"]
    assert group.tables == [(model.relative_attention_bias, "weight", 1)]
    exported, kept = exported_as_masked(pruner, model, inputs)
    torch.testing.assert_close(
        exported.relative_attention_bias.weight, model.relative_attention_bias.weight[:, kept]
    )
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_a_bias_from_outside_that_no_table_gives_refuses_its_layers():
    """The same layers handed a bias the model computes from a buffer, beside an
    embedding of one column per head that does not give it head by head: no table is
    proven, and the layers are refused by name."""
    torch.manual_seed(0)
    model, inputs = TableBiasedStack(from_table=False), (torch.randn(2, 6, 16),)
    with pytest.raises(ValueError, match=r"'layers.0': its forward takes `position_bias`.*no "):
        DTPPruner(model, inputs, {"heads": 0.5})


def tiny_mpnet():
    config = transformers.MPNetConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        pad_token_id=0,
    )
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    return transformers.MPNetForSequenceClassification(config).eval(), (ids,)


def test_mpnet_heads_are_tied_to_its_encoders_bias_table_and_export_exactly():
    """MPNet's encoder computes one relative position bias per head from its table and
    hands it to every layer: the layers' heads are one group with that table, and the
    export (the table's columns and the encoder's n_heads cut) computes what the
    hard-masked model computes, with the report's parameters."""
    torch.manual_seed(0)
    model, inputs = tiny_mpnet()
    encoder = model.mpnet.encoder
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5}))
    (tied,) = [g for g in pruner.groups if isinstance(g, TiedHeadGroup)]
    assert [m.module for m in tied.tied] == [layer.attention.attn for layer in encoder.layer]
    assert tied.tables == [(encoder.relative_attention_bias, "weight", 1)]
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cut = exported.mpnet.encoder
    assert cut.relative_attention_bias.weight.shape == (32, 2) and cut.n_heads == 2
    assert all(layer.attention.attn.o.in_features == 16 for layer in cut.layer)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_an_mpnet_layer_left_whole_refuses_the_heads_of_the_others():
    """A layer left whole would be handed the encoder's bias cut to fewer heads: the
    others' heads are refused, naming it."""
    model, inputs = tiny_mpnet()
    left = model.mpnet.encoder.layer[1].attention.attn
    with pytest.raises(ValueError, match=r"handed to 'mpnet.encoder.layer.1.attention.attn' too"):
        DTPPruner(model, inputs, {"heads": 0.5}, ignored_layers=[left])


class LinearTablesStack(torch.nn.Module):
    """Layers of BiasedAttention handed one bias per head that the model sums from two
    linear layers' weights of one row per head, indexed by bucket (LayoutLMv3's 1-D and
    2-D tables), and a classifier of as many outputs as there are heads that the bias
    does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(BiasedAttention(4, False) for _ in range(2))
        self.by_position = torch.nn.Linear(5, 4, bias=False)
        self.by_box = torch.nn.Linear(3, 4, bias=False)
        self.classifier = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = torch.arange(x.shape[1])
        buckets = (where[None] - where[:, None]).clamp(-2, 2) + 2
        bias = (self.by_position.weight[:, buckets] + self.by_box.weight[:, buckets % 3])[None]
        for layer in self.layers:
            out, _ = layer(x, position_bias=bias)
            x = x + out
        return self.classifier(x)


def test_a_bias_summed_from_linear_tables_ties_the_layers_with_those_tables_only():
    """A bias per head the model sums from linear layers of one output per head is
    proven with all of them cut: the layers are one group with those tables, and the
    classifier of as many outputs, which the bias does not read, keeps its outputs."""
    torch.manual_seed(0)
    model, inputs = LinearTablesStack(), (torch.randn(2, 6, 16),)
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5}))
    (group,) = pruner.groups
    assert [m.name for m in group.tied] == ["layers.0", "layers.1"]
    assert group.tables == [(model.by_position, "weight", 0), (model.by_box, "weight", 0)]
    exported, kept = exported_as_masked(pruner, model, inputs)
    torch.testing.assert_close(exported.by_box.weight, model.by_box.weight[kept])
    assert exported.by_position.out_features == 2 and exported.classifier.out_features == 4


def tiny_layoutlmv3():
    config = transformers.LayoutLMv3Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        coordinate_size=10,  # 4 coordinates and 2 sizes: the width
        shape_size=12,
        num_labels=3,
    )
    generator = torch.Generator().manual_seed(1)
    corners = torch.randint(0, 500, (2, 9, 2, 2), generator=generator).sort(dim=2).values
    inputs = {
        "input_ids": torch.randint(3, 64, (2, 9), generator=generator),
        "bbox": corners.transpose(2, 3).flatten(2),  # (x0, y0, x1, y1)
    }
    return transformers.LayoutLMv3ForSequenceClassification(config).eval(), inputs


def test_layoutlmv3_heads_are_tied_to_its_encoders_position_tables_and_export_exactly():
    """LayoutLMv3's encoder sums its 1-D and 2-D (x, y) relative position biases from
    three linear layers of one output per head and hands the sum to every layer: the
    layers' heads are one group with those three tables, and the export computes on
    words and their boxes what the hard-masked model computes, with the report's
    parameters."""
    torch.manual_seed(0)
    model, inputs = tiny_layoutlmv3()
    encoder = model.layoutlmv3.encoder
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5, "mlp": 0.5}))
    (tied,) = [g for g in pruner.groups if isinstance(g, TiedHeadGroup)]
    assert [m.module for m in tied.tied] == [layer.attention.self for layer in encoder.layer]
    tables = {encoder.rel_pos_bias, encoder.rel_pos_x_bias, encoder.rel_pos_y_bias}
    assert {owner for owner, _, _ in tied.tables if owner not in tied.module.modules()} == tables
    with torch.no_grad(), pruner.hard_masked():
        want = model(**inputs).logits
    exported = pruner.export().eval()
    with torch.no_grad():
        got = exported(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cut = exported.layoutlmv3.encoder
    assert cut.rel_pos_bias.weight.shape == (2, 32) and cut.rel_pos_y_bias.out_features == 2
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def tiny_shared_relpos_vit() -> torch.nn.Module:
    """timm's ViT with one relative-position MLP for all blocks (vit_srelpos's form): the
    model computes the bias per head once, from its RelPosMlp, whose last layer has one
    output per head and whose num_heads and bias_shape shape that bias."""
    timm = pytest.importorskip("timm")
    from timm.models.vision_transformer_relpos import VisionTransformerRelPos

    torch.manual_seed(0)
    model = VisionTransformerRelPos(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, qkv_bias=False,
        fc_norm=False, rel_pos_dim=16, shared_rel_pos=True, num_classes=5,
    )  # fmt: skip
    assert timm.__version__
    return model.eval()


def test_a_shared_relative_position_mlp_ties_the_blocks_heads_and_keeps_its_counts():
    """The blocks handed the shared bias (`shared_rel_pos`) are one group with the MLP's
    last layer; the proof and the export set the head counts of the modules holding it
    (RelPosMlp's num_heads and bias_shape), and the export computes what the
    hard-masked model computes, with the report's parameters."""
    model, x = tiny_shared_relpos_vit(), torch.randn(2, 3, 32, 32)
    pruner = randomised(DTPPruner(model, (x[:1],), {"heads": 0.5}))
    (tied,) = [g for g in pruner.groups if isinstance(g, TiedHeadGroup)]
    assert [m.module for m in tied.tied] == [block.attn for block in model.blocks]
    assert {owner for owner, _, _ in tied.tables} == {model.shared_rel_pos.mlp.fc2}
    exported, _ = exported_as_masked(pruner, model, (x,))
    shared = exported.shared_rel_pos
    assert (shared.num_heads, shared.bias_shape[-1], shared.mlp.fc2.out_features) == (2, 2, 2)
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, (x[:1],))


def test_a_tables_holders_are_its_parent_and_those_above_holding_no_layer():
    from dtp_kernels.pruning.heads import table_holders

    layers = ["encoder.layer.0.attention", "encoder.layer.1.attention"]
    assert table_holders("encoder.relative_attention_bias", layers) == ["encoder"]
    assert table_holders("relative_attention_bias", ["layers.0"]) == [""]  # the model's own
    blocks = ["blocks.0.attn", "blocks.1.attn"]
    assert table_holders("shared_rel_pos.mlp.fc2", blocks) == [
        "shared_rel_pos.mlp",
        "shared_rel_pos",
    ]
