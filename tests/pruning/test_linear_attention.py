"""Gated DeltaNet linear-attention heads (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid,
LaRA-mini; tiny configurations built here), Kimi Linear's and the Bailing hybrid's Kimi
Delta Attention heads and what prunes beside them: the gated attention of the Qwen
hybrids (each query head with its output gate) and their shared experts. The export
keeps exactly the key heads asked for with their value heads, computes what the
hard-masked model computes, generates as it does and loads from its saved config."""

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops
from dtp_kernels.pruning.gated_deltanet import LinearAttentionGroup
from dtp_kernels.pruning.heads import HeadGroup
from utils import LLAMA_VOCAB, described_export, randomised, tiny_kimi_linear

transformers = pytest.importorskip("transformers")

# 4 key heads of 8, 2 value heads of 8 each; every fourth layer full attention
LINEAR = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
SIZES = dict(
    vocab_size=LLAMA_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    **LINEAR,
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)
# family: (config, causal LM, extra sizes, its projections, its output projection)
FAMILIES = {
    "qwen3_next": ("Qwen3Next", "Qwen3Next", MOE, ("in_proj_qkvz", "in_proj_ba"), "out_proj"),
    "qwen3_5": ("Qwen3_5Text", "Qwen3_5", {}, ("in_proj_qkv", "in_proj_z"), "out_proj"),
    "qwen3_5_moe": ("Qwen3_5MoeText", "Qwen3_5Moe", MOE, ("in_proj_qkv", "in_proj_b"), "out_proj"),
    "olmo_hybrid": ("OlmoHybrid", "OlmoHybrid", {}, ("q_proj", "g_proj", "a_proj"), "o_proj"),
    "lara_mini": ("LaraMini", "LaraMini", {}, ("in_proj_qkv", "in_proj_a"), "out_proj"),
}


def hybrid(family: str):
    config_name, model_name, extra, _, _ = FAMILIES[family]
    config = getattr(transformers, f"{config_name}Config")(**SIZES, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{model_name}ForCausalLM")(config)
    tokens = torch.randint(3, LLAMA_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    return model, (tokens,)


def linear_layers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m).__name__.endswith("GatedDeltaNet")}


def check_generate_and_round_trip(pruner, model, exported, inputs, tmp_path) -> None:
    with torch.no_grad(), pruner.hard_masked():
        want = model.generate(*inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    got = exported.generate(*inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)  # the conv and recurrent states cached per layer
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, exported(*inputs).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_linear_attention_heads_export_exactly_the_kept_key_heads(family, tmp_path):
    model, inputs = hybrid(family)
    _, _, _, projections, output = FAMILIES[family]
    layers = linear_layers(model)
    assert len(layers) == (2 if family == "lara_mini" else 3)
    dense = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in layers.items()}
    pruner = randomised(DTPPruner(model, inputs, {"linear_attention": 0.5}))
    assert [g.name for g in pruner.groups] == list(layers)
    assert all(isinstance(g, LinearAttentionGroup) and g.size == 4 for g in pruner.groups)
    masks = pruner.hard_masks()
    exported, _ = described_export(pruner, model, inputs)
    assert exported.config.linear_num_key_heads == 2
    assert exported.config.linear_num_value_heads == 4
    cut = dict(exported.named_modules())
    for (name, original), mask in zip(layers.items(), masks, strict=True):
        layer, kept = cut[name], mask.nonzero().flatten()
        assert len(kept) == 2
        values = (kept[:, None] * 2 + torch.arange(2)).flatten()  # their value heads
        assert (layer.num_k_heads, layer.num_v_heads) == (2, 4)
        assert (layer.key_dim, layer.value_dim, layer.conv_dim) == (16, 32, 64)
        assert layer.conv1d.weight.shape[0] == layer.conv1d.groups == 64
        for table in ("A_log", "dt_bias"):
            torch.testing.assert_close(getattr(layer, table), dense[name][table][values])
        for projection in projections:  # a quarter of their rows each unit: half kept
            before = getattr(original, projection).out_features
            assert getattr(layer, projection).out_features == before // 2
        assert getattr(layer, output).in_features == 32
        # the output columns of exactly the kept value heads
        columns = (values[:, None] * 8 + torch.arange(8)).flatten()
        old = dense[name][f"{output}.weight"][:, columns]
        torch.testing.assert_close(getattr(layer, output).weight, old)
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs) < pruner.report()["flops_before"]
    check_generate_and_round_trip(pruner, model, exported, inputs, tmp_path)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "olmo_hybrid"])
def test_a_float_prunes_linear_and_gated_attention_experts_and_shared_experts(family, tmp_path):
    """A float asks for every group: the linear attention's heads, the full attention's
    (in the Qwen hybrids each query head's rows with its gate's), the experts' neurons and
    the shared expert's, and the config describes them all."""
    model, inputs = hybrid(family)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    kinds = {type(g).__name__ for g in pruner.groups}
    assert {"LinearAttentionGroup", "HeadGroup", "ChannelGroup"} <= kinds
    (full,) = [g for g in pruner.groups if type(g) is HeadGroup]
    attention = full.module
    gated = family != "olmo_hybrid"
    assert full.rows[0].per_unit == 2 * 8 * (2 if gated else 1)  # 2 query heads a unit
    exported, _ = described_export(pruner, model, inputs)
    if gated:  # each kept query head's rows with its gate's (OLMo-Hybrid's are rescaled)
        kept = pruner.hard_masks()[pruner.groups.index(full)].nonzero().flatten()
        rows = (kept[:, None] * 32 + torch.arange(32)).flatten()  # 2 heads, 2 x 8 each
        q = dict(exported.named_modules())[full.name].q_proj.weight
        torch.testing.assert_close(q, attention.q_proj.weight[rows])
    if family != "olmo_hybrid":
        assert exported.config.shared_expert_intermediate_size == 8
    check_generate_and_round_trip(pruner, model, exported, inputs, tmp_path)


def test_a_linear_attention_layer_mixing_its_heads_is_refused_by_name():
    """A layer of the form whose code mixes its heads (here its gated norm reads every
    head's output rows reversed) fails its proof and is refused by name, the model left
    untouched; the other layers still prune."""
    model, inputs = hybrid("qwen3_5")
    layer = model.model.layers[1].linear_attn
    norm = layer.norm

    class Reversed(type(norm)):
        def forward(self, hidden_states, gate):
            return super().forward(hidden_states.flip(0), gate)

    norm.__class__ = Reversed
    with pytest.raises(ValueError, match=r"linear-attention layer 'model.layers.1.linear_attn'"):
        DTPPruner(model, inputs, {"linear_attention": 0.5})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    pruner = DTPPruner(model, inputs, {"linear_attention": 0.5, "model.layers.1.*": 0})
    assert [g.name for g in pruner.groups] == [
        "model.layers.0.linear_attn",
        "model.layers.2.linear_attn",
    ]


def test_kimi_delta_attention_heads_export_exactly_the_kept_heads(tmp_path):
    """Each kept head keeps its rows of q, k, v, the forget gate's f_b_proj and the
    output gate's g_b_proj, its b_proj row, its three runs of conv channels, its
    decay bias (one per channel) and A_log entry and its output columns; the low-rank
    inputs stay whole, and the config's `linear_num_heads` describes the layers."""
    model = tiny_kimi_linear()
    inputs = (torch.randint(3, LLAMA_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)),)
    layers = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("DeltaAttention")}
    assert list(layers) == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    dense = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in layers.items()}
    pruner = randomised(DTPPruner(model, inputs, {"linear_attention": 0.5}))
    assert [g.name for g in pruner.groups] == list(layers)
    assert all(isinstance(g, LinearAttentionGroup) and g.size == 4 for g in pruner.groups)
    masks = pruner.hard_masks()
    exported, _ = described_export(pruner, model, inputs)
    assert exported.config.linear_num_heads == 2
    cut = dict(exported.named_modules())
    for (name, original), mask in zip(layers.items(), masks, strict=True):
        layer, kept = cut[name], mask.nonzero().flatten()
        assert len(kept) == 2
        channels = (kept[:, None] * 8 + torch.arange(8)).flatten()
        assert (layer.num_heads, layer.qkv_dim, layer.conv_dim) == (2, 16, 48)
        conv = torch.cat([channels + run * 32 for run in range(3)])
        torch.testing.assert_close(layer.conv1d.weight, dense[name]["conv1d.weight"][conv])
        gate = layer.forget_gate
        torch.testing.assert_close(gate.dt_bias, dense[name]["forget_gate.dt_bias"][channels])
        torch.testing.assert_close(gate.A_log, dense[name]["forget_gate.A_log"][:, :, kept])
        for rows in ("q_proj", "k_proj", "v_proj", "g_b_proj", "forget_gate.f_b_proj"):
            torch.testing.assert_close(
                exported.get_submodule(f"{name}.{rows}").weight,
                dense[name][f"{rows}.weight"][channels],
            )
        torch.testing.assert_close(layer.b_proj.weight, dense[name]["b_proj.weight"][kept])
        torch.testing.assert_close(layer.o_proj.weight, dense[name]["o_proj.weight"][:, channels])
        for whole in ("g_a_proj", "forget_gate.f_a_proj"):  # the low-rank inputs stay
            assert exported.get_submodule(f"{name}.{whole}").weight.shape == (
                original.get_submodule(whole).weight.shape
            )
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs) < pruner.report()["flops_before"]
    check_generate_and_round_trip(pruner, model, exported, inputs, tmp_path)


def tiny_bailing_hybrid() -> torch.nn.Module:
    """The Bailing hybrid: a Kimi Delta Attention layer (4 heads of 8) with full-rank
    gates (`g_proj`, the forget gate's `f_proj`), then a latent-attention layer with
    mixture-of-experts MLPs."""
    config = transformers.BailingHybridConfig(
        vocab_size=LLAMA_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
        num_experts=4,
        num_experts_per_token=2,
        num_expert_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        linear_num_heads=4,
        linear_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.BailingHybridForCausalLM(config)


def test_bailing_hybrid_delta_attention_heads_with_full_rank_gates(tmp_path):
    """The Bailing hybrid's linear-attention layer is Kimi Delta Attention with full-rank
    gates: each kept head keeps its rows of q, k, v, the output gate's g_proj and the
    forget gate's f_proj, its b_proj row, conv channels, decay bias and A_log entry and
    its output columns; a float prunes it with the latent attention's heads and the
    experts, exported equal to the hard-masked model with the counts predicted, and the
    config's `linear_num_heads` describes it."""
    model = tiny_bailing_hybrid()
    inputs = (torch.randint(3, LLAMA_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)),)
    name = "model.layers.0.self_attn"
    dense = {k: v.clone() for k, v in model.get_submodule(name).state_dict().items()}
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    groups = {g.name: g for g in pruner.groups}
    assert isinstance(groups[name], LinearAttentionGroup) and groups[name].size == 4
    assert isinstance(groups["model.layers.1.self_attn"], HeadGroup)
    kept = pruner.hard_masks()[list(groups).index(name)].nonzero().flatten()
    exported, _ = described_export(pruner, model, inputs)
    assert exported.config.linear_num_heads == 2
    layer = exported.get_submodule(name)
    channels = (kept[:, None] * 8 + torch.arange(8)).flatten()
    assert (layer.num_heads, layer.qkv_dim, layer.conv_dim, layer.forget_gate.num_heads) == (
        2,
        16,
        48,
        2,
    )
    for rows in ("q_proj", "k_proj", "v_proj", "g_proj", "forget_gate.f_proj"):
        torch.testing.assert_close(
            layer.get_submodule(rows).weight, dense[f"{rows}.weight"][channels]
        )
    torch.testing.assert_close(layer.forget_gate.dt_bias, dense["forget_gate.dt_bias"][channels])
    torch.testing.assert_close(layer.forget_gate.A_log, dense["forget_gate.A_log"][kept])
    torch.testing.assert_close(layer.b_proj.weight, dense["b_proj.weight"][kept])
    torch.testing.assert_close(layer.o_proj.weight, dense["o_proj.weight"][:, channels])
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs)
    check_generate_and_round_trip(pruner, model, exported, inputs, tmp_path)
