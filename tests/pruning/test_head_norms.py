"""Norms over all the heads of an attention layer (OLMo 2's q_norm and k_norm; BitNet's
attn_sub_norm of the attention output), kept exact as heads go: the norm is matched to
the projection whose output it reads as it is (or to the output projection reading it),
only an RMS norm of weight times the normalized input is cut and rescaled, and a model
held in bfloat16 exports within the dtype's rounding of its rescaled weights."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, load_pruned, save_pruned
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.head_norms import (
    cut_norm,
    fed_norms,
    norms_after_output,
    norms_read_by,
    rescales_exactly,
)
from dtp_kernels.pruning.heads import HeadGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import hard_masked_and_exported, randomised, tiny_bitnet

transformers = pytest.importorskip("transformers")


class TwoProjections(nn.Module):
    """Two projections of one width; the norm reads the second, as it is or scaled."""

    def __init__(self, as_it_is: bool) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(4, 8), nn.Linear(4, 8), nn.RMSNorm(8)
        self.as_it_is = as_it_is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        return a + self.norm(b if self.as_it_is else 2 * b)


@pytest.mark.parametrize("as_it_is", [True, False])
def test_a_norm_is_matched_to_the_projection_whose_output_it_reads_as_it_is(as_it_is):
    model = TwoProjections(as_it_is)
    candidates = {model.norm: [(model.a, 2), (model.b, 2)]}
    fed = fed_norms(model, (torch.randn(3, 4),), candidates)
    assert fed == ({model.norm: (model.b, 2)} if as_it_is else {})
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class NormedOutput(nn.Module):
    """A norm of what feeds the output projection, read by it as it is or scaled."""

    def __init__(self, as_it_is: bool) -> None:
        super().__init__()
        self.inner, self.norm, self.out = nn.Linear(4, 8), nn.RMSNorm(8), nn.Linear(8, 4)
        self.as_it_is = as_it_is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.inner(x))
        return self.out(y if self.as_it_is else 2 * y)


@pytest.mark.parametrize("as_it_is", [True, False])
def test_a_norm_of_the_attention_output_is_one_the_output_projection_reads_as_it_is(as_it_is):
    model = NormedOutput(as_it_is)
    found = norms_read_by(model, (torch.randn(3, 4),), {model.norm: [model.out]})
    assert found == ({model.norm} if as_it_is else set())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class SharedLayer(nn.Module):
    """One layer called twice (ALBERT's sharing): a norm over what feeds its output
    projection and a norm of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.norm, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.after = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = self.after(x + self.out(self.norm(self.inner(x))))
        return x


def test_a_norm_after_the_output_projection_is_found_in_a_layer_called_twice():
    """ALBERT's LayerNorm of the residual stream runs after the output projection; the
    norm before it does too from the second call on, and is not taken for one after."""
    model = SharedLayer()
    candidates = {model.norm: model.out, model.after: model.out}
    assert norms_after_output(model, (torch.randn(3, 8),), candidates) == {model.after}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def olmo2_norm(width: int) -> nn.Module:
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return Olmo2RMSNorm(width)


def gemma3_norm(width: int) -> nn.Module:  # its weight is read as 1 + w
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    return Gemma3RMSNorm(width)


@pytest.mark.parametrize(
    "make, exact",
    [(olmo2_norm, True), (nn.RMSNorm, True), (nn.LayerNorm, False), (gemma3_norm, False)],
    ids=["olmo2", "torch-rmsnorm", "layernorm", "gemma3"],
)
def test_only_a_norm_of_weight_times_the_rms_normalized_input_rescales_exactly(make, exact):
    assert rescales_exactly(make(16)) == exact


def test_the_cut_norm_computes_on_the_kept_rows_what_it_computed_with_the_rest_zero():
    """The rescaling in numbers: the projection's kept rows times sqrt(K / N), the norm's
    weight over it, its epsilon as it was (the config's)."""
    torch.manual_seed(0)
    norm, rows = olmo2_norm(12), nn.Linear(6, 12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, kept = torch.randn(5, 6), torch.tensor([0, 1, 2, 6, 7, 8])
    mask = torch.zeros(12)
    mask[kept] = 1
    want = norm(rows(x) * mask)[:, kept]
    cut = nn.Linear(6, 6)
    cut.weight, cut.bias = nn.Parameter(rows.weight[kept]), nn.Parameter(rows.bias[kept])
    epsilon = norm.variance_epsilon
    cut_norm(norm, cut, kept)
    torch.testing.assert_close(norm(cut(x)), want)
    assert norm.weight.shape == (6,) and norm.variance_epsilon == epsilon
    torch.testing.assert_close(cut.weight, rows.weight[kept] * 0.5**0.5)


def olmo2(dtype: torch.dtype) -> tuple[nn.Module, tuple]:
    config = transformers.Olmo2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    return transformers.Olmo2ForCausalLM(config).to(dtype), (ids,)


def test_a_model_held_in_bfloat16_exports_within_its_rounding():
    """The rescaled weights round to bfloat16, so the export check allows the dtype's
    rounding, as the proof does (within 1% here); the heads are cut all the same."""
    model, inputs = olmo2(torch.bfloat16)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [len(g.rescaled) for g in heads] == [2, 2]
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    attention = exported.model.layers[0].self_attn  # one unit of two query heads kept
    assert (attention.q_norm.weight.numel(), attention.k_norm.weight.numel()) == (16, 8)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max())


def test_a_training_step_reaches_the_scores_through_the_norms_too():
    """The soft mask scales the queries and keys a norm over all heads reads: the
    scores get a gradient through them, not through the output projection alone."""
    model, inputs = olmo2(torch.float32)
    pruner = DTPPruner(model, inputs, {"heads": 0.5})
    attention = model.model.layers[0].self_attn
    for layer in (attention.q_proj, attention.k_proj):
        assert nn.utils.parametrize.is_parametrized(layer, "weight")
    assert not nn.utils.parametrize.is_parametrized(attention.v_proj)
    model(*inputs, labels=inputs[0]).loss.backward()
    through_all = pruner.scores.grad.clone()
    pruner.scores.grad = None
    nn.utils.parametrize.remove_parametrizations(attention.q_proj, "weight")
    nn.utils.parametrize.remove_parametrizations(attention.k_proj, "weight")
    model(*inputs, labels=inputs[0]).loss.backward()
    assert not torch.allclose(through_all[:2], pruner.scores.grad[:2])


MOE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.mark.parametrize(
    "family, sizes",
    [
        ("FlexOlmo", dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        ("MiniMaxM2", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    ],
)
def test_the_other_families_with_norms_over_all_heads_prune_with_a_float(family, sizes):
    """A float ratio prunes their heads (norms cut and rescaled) and experts' neurons,
    exported equal to the hard-masked model with the parameters predicted."""
    config = getattr(transformers, f"{family}Config")(num_hidden_layers=2, **MOE, **sizes)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    inputs = (torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)),)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [len(g.rescaled) for g in heads] == [2, 2]
    assert {type(g).__name__ for g in pruner.groups} == {"HeadGroup", "ExpertGroup"}
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert exported.model.layers[1].self_attn.k_norm.weight.numel() == 8
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["grouped-query", "multi-head"])
def test_bitnet_heads_prune_through_the_norm_of_their_output(kv_heads, tmp_path):
    """The mask zeroes a removed unit's value rows, so its query heads' outputs are zero
    before the norm; export cuts the norm to the kept query heads' channels (not the
    value rows: fewer under grouped-query attention) and rescales it with the values.
    BitNet sizes attn_sub_norm by hidden_size, so no config describes fewer heads: it
    is left unchanged, with a warning, and save_pruned keeps the counts."""
    model = tiny_bitnet(kv_heads)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    pruner = randomised(DTPPruner(model, (ids[:1],), 0.5))
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    attention = model.model.layers[0].self_attn
    assert [(r.norm, r.rows, r.per_unit) for r in heads[0].rescaled] == [
        (attention.attn_sub_norm, attention.v_proj, 8)
    ]
    assert nn.utils.parametrize.is_parametrized(attention.v_proj, "weight")
    with pytest.warns(UserWarning, match="the config is unchanged"):
        exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cut = exported.model.layers[0].self_attn
    assert (cut.attn_sub_norm.weight.numel(), cut.v_proj.out_features) == (16, 4 * kv_heads)
    assert count_params(exported) == pruner.report()["params_after"]
    assert exported.config.num_attention_heads == 4
    kwargs = {"family": "BitNet", "sizes": model.config.to_diff_dict()}
    save_pruned(tmp_path / "f", exported, builder="utils:causal_lm", builder_kwargs=kwargs)
    with torch.no_grad():
        loaded = load_pruned(tmp_path / "f").eval()(ids).logits
    torch.testing.assert_close(loaded, got, rtol=1e-5, atol=1e-5)


def test_bitnet_scores_reach_through_the_value_rows():
    """The soft mask scales the values before the norm: the scores' gradient differs
    from the one through the output projection's columns alone."""
    model = tiny_bitnet(2)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    pruner = DTPPruner(model, (ids,), {"heads": 0.5})
    model(ids, labels=ids).loss.backward()
    through_all = pruner.scores.grad.clone()
    pruner.scores.grad = None
    nn.utils.parametrize.remove_parametrizations(model.model.layers[0].self_attn.v_proj, "weight")
    model(ids, labels=ids).loss.backward()
    assert not torch.allclose(through_all[:2], pruner.scores.grad[:2])
    torch.testing.assert_close(through_all[2:], pruner.scores.grad[2:])


def layer_normed_output(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:  # subtracts the mean: no rescaling keeps it
        layer.self_attn.attn_sub_norm = nn.LayerNorm(32)
    return model


@pytest.mark.parametrize(
    "model",
    [lambda: tiny_bitnet(1), lambda: layer_normed_output(tiny_bitnet(2))],
    ids=["multi-query", "layernorm"],
)
def test_bitnet_heads_the_norm_cannot_follow_are_refused_by_name(model):
    """With one key/value head for all, a unit is a query head: no value rows are its
    own to zero before the norm; a LayerNorm does not rescale. Refused naming the norm,
    nothing mutated; the MLPs still prune."""
    model = model()
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"feeds \w+ 'model.layers.0.self_attn.attn_sub_norm'"):
        DTPPruner(model, (ids,), 0.5)
    assert not any(nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    assert [type(g).__name__ for g in DTPPruner(model, (ids,), {"mlp": 0.5}).groups] == [
        "FormMLPGroup"
    ] * 2
