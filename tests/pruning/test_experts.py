"""The experts of mixture-of-experts blocks (tiny Hugging Face configurations built here,
nothing downloaded): every expert's intermediate neurons are a group, the export keeps
exactly the kept neurons of each expert in the smaller 3-D parameters and computes what
the hard-masked model computes, in every weight layout transformers uses (gate and up
concatenated or interleaved, stored transposed, with biases, without a gate), under every
experts implementation; counts and config follow, and what cannot be held is refused."""

import contextlib
import warnings

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, L1Pruner
from dtp_kernels.pruning.cost import ExpertMatmul, count_flops, trace_layers
from dtp_kernels.pruning.experts import WIDTH_ATTRIBUTES, ExpertGroup, expert_layout
from dtp_kernels.pruning.heads import HeadGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import (
    bf16_step_and_export,
    hard_masked_and_exported,
    randomised,
    tiny_dbrx,
    tiny_deepseek,
)

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
EXPERTS, TOP_K, BATCH, LENGTH = 4, 2, 2, 9


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))


# families whose causal LM is not named after their config
CAUSAL_LM = {"Llama4Text": "Llama4ForCausalLM"}


def moe(family: str, **sizes) -> tuple[nn.Module, tuple]:
    """A tiny `{family}ForCausalLM` with EXPERTS experts, TOP_K chosen per token."""
    config = getattr(transformers, f"{family}Config")(**{**SIZES, **sizes})
    causal_lm = CAUSAL_LM.get(family, f"{family}ForCausalLM")
    return getattr(transformers, causal_lm)(config), (tokens(),)


MIXTRAL = dict(num_hidden_layers=2, intermediate_size=64, num_local_experts=EXPERTS)
# family -> (sizes, experts' width, (parts, concatenated, transposed, bias), config follows)
FAMILIES = {
    "Mixtral": (MIXTRAL, 64, (2, True, False, False), True),
    "Qwen3Moe": (  # its dense MLP width and the experts' are separate fields
        dict(
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            head_dim=8,
        ),
        16,
        (2, True, False, False),
        True,
    ),
    "Qwen2Moe": (  # beside a shared expert (a gated MLP of its own width)
        dict(
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
        ),
        16,
        (2, True, False, False),
        True,
    ),
    "Olmoe": (
        dict(
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            num_key_value_heads=4,
        ),
        32,
        (2, True, False, False),
        True,
    ),
    "GptOss": (  # gate and up interleaved, stored (in, out), with biases
        dict(
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            head_dim=8,
        ),
        32,
        (2, False, True, True),
        True,
    ),
    "NemotronH": (  # no gate: up_proj only; an attention layer and an MoE layer
        dict(
            layers_block_type=["attention", "moe"],
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            intermediate_size=32,
            head_dim=8,
            mtp_layers_block_type=None,
        ),
        16,
        (1, True, False, False),
        True,
    ),
    "Llama4Text": (  # no layout flags (known by its class): stored (in, out), gate and up
        # chunked; every expert computes on every token; its shared expert is
        # intermediate_size wide too, so the config cannot describe experts pruned alone
        dict(
            num_hidden_layers=2,
            intermediate_size=16,
            intermediate_size_mlp=32,
            num_local_experts=EXPERTS,
            num_experts_per_tok=1,
            head_dim=8,
        ),
        16,
        (2, True, True, False),
        False,
    ),
    "AriaText": (  # stored (in, out); its shared experts are intermediate_size wide too,
        # so the config cannot describe experts pruned alone
        dict(
            num_hidden_layers=2,
            intermediate_size=16,
            moe_num_experts=EXPERTS,
            moe_topk=TOP_K,
            moe_num_shared_experts=1,
        ),
        16,
        (2, True, True, False),
        False,
    ),
}


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith(".experts")}


def intermediate(weight: torch.Tensor, transposed: bool, up: bool) -> torch.Tensor:
    """One expert's weight with the intermediate dimension first."""
    if transposed:
        return weight.t() if up else weight
    return weight if up else weight.t()


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_export_the_kept_neurons_of_every_expert(family, tmp_path):
    """One group per expert; the export equals the hard-masked model and keeps exactly
    each expert's kept neurons (gate and up rows, down columns, biases) in every layout;
    parameters, FLOPs, the width attribute and, where it can, the config follow."""
    sizes, width, (parts, concatenated, transposed, bias), config_follows = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = moe(family, **sizes)
    blocks = experts_modules(model)
    dense = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in blocks.items()}
    pruner = randomised(DTPPruner(model, inputs, {"experts": 0.5}))
    assert [g.name for g in pruner.groups] == [f"{b}.{e}" for b in blocks for e in range(EXPERTS)]
    assert all(isinstance(g, ExpertGroup) and g.size == width for g in pruner.groups)
    layout = pruner.groups[0].layout
    assert (layout.parts, layout.concatenated, layout.transposed, layout.bias) == (
        parts,
        concatenated,
        transposed,
        bias,
    )
    masks = pruner.hard_masks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    described = not any("config cannot describe" in str(w.message) for w in caught)
    assert described == config_follows
    # widths of a multiple of 16 bytes: the experts implementation stays as it was
    assert exported.config._experts_implementation == model.config._experts_implementation

    # exactly the kept neurons, each expert its own: gate and up rows, down columns, biases
    pruned_blocks = experts_modules(exported)
    up_name = layout.up
    for index, (name, block) in enumerate(pruned_blocks.items()):
        for e in range(EXPERTS):
            kept = masks[index * EXPERTS + e].nonzero().flatten()
            assert len(kept) == width // 2
            down = intermediate(block.down_proj[e], transposed, up=False)
            old_down = intermediate(dense[name]["down_proj"][e], transposed, up=False)
            torch.testing.assert_close(down, old_down[kept], rtol=0, atol=0)
            up = intermediate(getattr(block, up_name)[e], transposed, up=True)
            old_up = intermediate(dense[name][up_name][e], transposed, up=True)
            if parts == 1:
                rows = kept
            elif concatenated:
                rows = torch.cat([kept, kept + width])
            else:
                rows = torch.stack([2 * kept, 2 * kept + 1], dim=1).flatten()
            torch.testing.assert_close(up, old_up[rows], rtol=0, atol=0)
            if bias:
                old_bias = dense[name][f"{up_name}_bias"][e]
                torch.testing.assert_close(getattr(block, f"{up_name}_bias")[e], old_bias[rows])
        widths = {getattr(block, a) for a in WIDTH_ATTRIBUTES if hasattr(block, a)}
        assert widths == {width // 2}  # the module's own width attributes follow

    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs) < pruner.report()["flops_before"]
    if config_follows:  # save_pretrained / from_pretrained rebuild the pruned experts
        exported.save_pretrained(tmp_path)
        loaded = type(exported).from_pretrained(tmp_path).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(*inputs).logits, got)


@pytest.mark.parametrize("family", ["Mixtral", "Olmoe"])
def test_a_float_ratio_prunes_heads_and_experts_together(family, tmp_path):
    """A float asks for every group: heads and experts export together and the config
    describes both. OLMoE normalizes the queries of all heads together (its norms cut
    and rescaled with them), a norm its code builds from hidden_size: its config cannot
    describe fewer heads, so it stays, with a warning."""
    torch.manual_seed(0)
    sizes = {k: v for k, v in FAMILIES[family][0].items() if k != "num_key_value_heads"}
    model, inputs = moe(family, **sizes)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    kinds = [type(g).__name__ for g in pruner.groups]
    assert kinds == (["HeadGroup"] + ["ExpertGroup"] * EXPERTS) * 2
    rescaled = [len(g.rescaled) for g in pruner.groups if isinstance(g, HeadGroup)]
    assert rescaled == [2 if family == "Olmoe" else 0] * 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    if family == "Olmoe":
        assert any("config cannot describe" in str(w.message) for w in caught)
        return
    config = exported.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.intermediate_size == 32
    exported.save_pretrained(tmp_path)
    with torch.no_grad():
        loaded = type(exported).from_pretrained(tmp_path).eval()
        torch.testing.assert_close(loaded(*inputs).logits, got)


def test_the_config_field_written_is_the_one_holding_the_experts_width():
    """A config may hold moe_intermediate_size beside the intermediate_size its experts
    are built from (DeepSeek-V4's; here set on a Mixtral): the field written is the one
    equal to the experts' width."""
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    model.config.moe_intermediate_size = 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the config describes the export
        exported = DTPPruner(model, inputs, {"experts": 0.5}).export()
    assert (exported.config.intermediate_size, exported.config.moe_intermediate_size) == (32, 16)


def test_the_l1_baseline_keeps_each_experts_largest_neurons():
    """L1Pruner (one shot, same groups) keeps in every expert the neurons of largest
    gate and up L1 norm."""
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    exported = L1Pruner(model, inputs, {"experts": 0.75}).export()
    for e in range(EXPERTS):
        norms = gate_up[e, :64].abs().sum(1) + gate_up[e, 64:].abs().sum(1)
        kept = norms.topk(16).indices.sort().values
        want = torch.cat([gate_up[e, kept], gate_up[e, 64 + kept]])
        got = exported.model.layers[0].mlp.experts.gate_up_proj[e]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_masks_reach_every_experts_implementation(implementation):
    """transformers runs experts through a loop over experts (eager) or other kernels
    (batched_mm, grouped_mm), all reading the same parameters: the hard-masked model
    under each equals the export, and the mask changes what the dense model computes."""
    torch.manual_seed(0)
    model, inputs = moe("Qwen3Moe", **FAMILIES["Qwen3Moe"][0])
    pruner = randomised(DTPPruner(model, inputs, {"experts": 0.5}))
    exported = pruner.export().eval()
    model.eval()
    model.config._experts_implementation = implementation
    with torch.no_grad():
        with pruner.hard_masked():
            masked = model(*inputs).logits
        unmasked = pruner._unmasked_copy()(*inputs).logits
        torch.testing.assert_close(masked, exported(*inputs).logits, rtol=1e-5, atol=1e-5)
    assert (masked - unmasked).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["Mixtral", "GptOss"])
def test_initial_scores_are_the_norms_of_each_neurons_gate_and_up_weights(family):
    torch.manual_seed(0)
    model, inputs = moe(family, **FAMILIES[family][0])
    pruner = DTPPruner(model, inputs, {"experts": 0.5})
    gate_up = next(iter(experts_modules(model).values())).gate_up_proj.detach()
    width = FAMILIES[family][1]
    for e, scores in enumerate(pruner.scores.detach().split(pruner.sizes)[:EXPERTS]):
        rows = gate_up[e].t() if family == "GptOss" else gate_up[e]
        if family == "GptOss":  # interleaved: neuron j is rows 2j and 2j + 1
            gate, up = rows[0::2], rows[1::2]
        else:
            gate, up = rows[:width], rows[width:]
        want = (gate.pow(2).sum(1) + up.pow(2).sum(1)).sqrt()
        torch.testing.assert_close(scores, want.float())


def test_a_training_step_reaches_every_experts_scores():
    """Soft masks in training: the loss reaches the scores of every expert a token was
    routed to, and a step with the pruner attached commits the transport state."""
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    pruner = DTPPruner(model, inputs, {"experts": 0.5})
    optimizer = torch.optim.SGD([*model.parameters(), *pruner.parameters()], lr=0.1)
    pruner.attach(optimizer)
    model.train()
    model(*inputs, labels=inputs[0]).loss.backward()
    grads = pruner.scores.grad.split(pruner.sizes)
    routed = [m.rows > 0 for m in trace_layers(model, inputs) if isinstance(m, ExpertMatmul)]
    routed = routed[1::2]  # the down projection of every expert, in group order
    assert [bool(g.abs().sum() > 0) for g in grads] == routed
    optimizer.step()
    assert int(pruner.state.steps) == 1 and pruner.state.log_odds.abs().sum() > 0


def test_the_masked_weight_is_made_once_per_forward_and_the_gradients_hold():
    """The eager experts loop reads the down projection once per expert it runs: the
    masked weight is made once per forward and read back while the weight is unchanged
    (an in-place change makes it again), and the score gradients equal those of
    batched_mm, which reads it once."""
    grads = {}
    for implementation in ("eager", "batched_mm"):
        torch.manual_seed(0)
        model, inputs = moe("Mixtral", **MIXTRAL)
        model.config._experts_implementation = implementation
        pruner = randomised(DTPPruner(model, inputs, {"experts": 0.5}))
        model.train()
        model(*inputs, labels=inputs[0]).loss.backward()
        assert pruner._source.products == {}  # nothing held past the forward
        grads[implementation] = pruner.scores.grad.clone()
    torch.testing.assert_close(grads["eager"], grads["batched_mm"], rtol=1e-4, atol=1e-6)

    block, seen = model.model.layers[0].mlp.experts, []

    def reads(module, *_):
        first, again = module.down_proj, module.down_proj
        module.parametrizations.down_proj.original.mul_(1.0)  # a new version
        seen.append((first is again, module.down_proj is first))

    block.register_forward_hook(reads)
    model.eval()
    with torch.no_grad():
        model(*inputs)
    assert seen == [(True, False)] and pruner._source.products == {}


def test_the_experts_flops_count_the_tokens_routed_to_each():
    """Each block's experts together run every token TOP_K times (once per chosen
    expert): the example forward's routing, not all tokens for every expert."""
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL, num_experts_per_tok=TOP_K)
    matmuls = [m for m in trace_layers(model, inputs) if isinstance(m, ExpertMatmul)]
    for block in experts_modules(model).values():
        downs = [m for m in matmuls if m.module.experts is block and m.module.name == "down_proj"]
        assert len(downs) == EXPERTS
        assert sum(m.rows for m in downs) == BATCH * LENGTH * TOP_K
        assert len({m.rows for m in downs}) > 1  # routing, not an even split


def test_experts_that_compute_on_every_token_count_every_token():
    """Llama 4's block hands every expert every token (weighted by its router score, 0
    where it was not chosen), and its experts compute on all of them: that is what they
    cost."""
    torch.manual_seed(0)
    model, inputs = moe("Llama4Text", **FAMILIES["Llama4Text"][0])
    matmuls = [m for m in trace_layers(model, inputs) if isinstance(m, ExpertMatmul)]
    assert len(matmuls) == 2 * EXPERTS * 2  # up and down, per expert, per layer
    assert {m.rows for m in matmuls} == {BATCH * LENGTH}


def test_raw_experts_of_a_layout_not_recognised_are_named_and_stay_whole():
    """A module holding experts in a 3-D down_proj without transformers' layout flags and
    not of a known class: no group is found for it, and a warning names it."""

    class OwnExperts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(2, 8, 4))
            self.down_proj = nn.Parameter(torch.randn(2, 4, 4))

        def forward(self, x):
            return torch.einsum("ti,eoi->to", x, self.gate_up_proj[:, :4])

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.experts, self.down = nn.Linear(4, 8), OwnExperts(), nn.Linear(8, 4)

        def forward(self, x):
            return self.down(torch.relu(self.up(x))) + self.experts(x)

    with pytest.warns(UserWarning, match=r"the experts of \['experts'\] are kept in raw param"):
        pruner = DTPPruner(Block(), torch.randn(3, 4), 0.5)
    assert [g.name for g in pruner.groups] == ["up"]


def test_dbrx_experts_in_2d_parameters_export_the_kept_neurons_of_every_expert(tmp_path):
    """DBRX keeps each block's experts in three raw 2-D parameters of its experts
    module's `mlp`, one expert's matrix after another: w1 (gate) and v1 (up) [E * I, H],
    w2 (down) [E * I, H], neuron j of expert e in row e I + j of each. Its experts prune
    like transformers' (no warning; its router's [E, H] weight is not an expert's): the
    export keeps exactly each expert's kept rows, computes what the hard-masked model
    does, parameters and routed FLOPs follow, and with its heads whole (DBRX derives the
    head size from d_model / n_heads) ffn_config.ffn_hidden_size describes the export."""
    model, inputs = tiny_dbrx(ffn_hidden_size=16, experts=4), (tokens(),)
    blocks = [f"transformer.blocks.{i}.ffn.experts" for i in (0, 1)]
    dense = {b: model.get_submodule(b).mlp.state_dict() for b in blocks}
    dense = {b: {k: v.clone() for k, v in weights.items()} for b, weights in dense.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "kept in raw parameters" warning
        pruner = randomised(DTPPruner(model, inputs, {"heads": 0, "experts": 0.5}))
    assert [g.name for g in pruner.groups] == [f"{b}.{e}" for b in blocks for e in range(4)]
    masks = pruner.hard_masks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the config describes the export
        exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for index, name in enumerate(blocks):
        block = exported.get_submodule(name)
        rows = torch.cat([e * 16 + masks[index * 4 + e].nonzero().flatten() for e in range(4)])
        for weight in ("w1", "v1", "w2"):
            kept = getattr(block.mlp, weight)
            torch.testing.assert_close(kept, dense[name][weight][rows], rtol=0, atol=0)
        assert block.ffn_hidden_size == block.mlp.ffn_hidden_size == 8
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs) < pruner.report()["flops_before"]
    matmuls = [m for m in trace_layers(model, inputs) if isinstance(m, ExpertMatmul)]
    downs = [m for m in matmuls if m.module.name == "mlp.w2"]
    assert sum(m.rows for m in downs) == BATCH * LENGTH * model.config.ffn_config.moe_top_k * 2
    assert exported.config.ffn_config.ffn_hidden_size == 8
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, got)


JETMOE = dict(  # beside its mixture of attention experts
    num_hidden_layers=2,
    kv_channels=8,
    intermediate_size=16,
    num_local_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
)


def test_jetmoe_experts_export_the_kept_neurons_of_every_expert(tmp_path):
    """JetMoe's experts block routes its tokens itself and keeps its experts in two
    modules of its own: input_linear.weight [E, 2I, H] (each expert's gate rows, then its
    up rows) and output_linear.weight [E, H, I]. Its experts prune: the export keeps
    exactly each expert's kept neurons, computes what the hard-masked model does, and
    parameters and FLOPs follow, the FLOPs counting the tokens its router hands each
    expert; its mixture of attention experts, another layout, is named and stays whole,
    and the config describes the export."""
    torch.manual_seed(0)
    model, inputs = moe("JetMoe", **JETMOE)
    blocks = [f"model.layers.{i}.mlp" for i in (0, 1)]
    dense = {
        b: [
            model.get_submodule(f"{b}.{p}_linear").weight.detach().clone()
            for p in ("input", "output")
        ]
        for b in blocks
    }
    with pytest.warns(UserWarning, match=r"self_attention\.experts\.input_linear"):
        pruner = randomised(DTPPruner(model, inputs, {"experts": 0.5}))
    assert [g.name for g in pruner.groups] == [f"{b}.{e}" for b in blocks for e in range(EXPERTS)]
    masks = pruner.hard_masks()
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for index, name in enumerate(blocks):
        up, down = dense[name]
        for e in range(EXPERTS):
            kept = masks[index * EXPERTS + e].nonzero().flatten()
            block = exported.get_submodule(name)
            rows = torch.cat([kept, kept + 16])  # its gate's, then its up's
            torch.testing.assert_close(block.input_linear.weight[e], up[e][rows], rtol=0, atol=0)
            torch.testing.assert_close(
                block.output_linear.weight[e], down[e][:, kept], rtol=0, atol=0
            )
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs) < pruner.report()["flops_before"]
    matmuls = [m for m in trace_layers(model, inputs) if isinstance(m, ExpertMatmul)]
    downs = [m for m in matmuls if m.module.name == "output_linear.weight"]
    assert sum(m.rows for m in downs) == BATCH * LENGTH * TOP_K * 2
    assert len({m.rows for m in downs}) > 1  # routing, not an even split
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, got)


def test_experts_of_one_block_with_different_ratios_are_refused_by_name():
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    with pytest.raises(ValueError, match=r"experts of 'model.layers.0.mlp.experts' have diff"):
        DTPPruner(model, inputs, {"model.layers.0.mlp.experts.0": 0.5})
    DTPPruner(model, inputs, {"model.layers.0.mlp.experts.*": 0.5}).remove()  # one ratio


def test_a_global_budget_over_experts_is_refused():
    """One segment over all groups would keep a count per expert."""
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    with pytest.raises(ValueError, match=r"budget = 'global' .* 'model.layers.0.mlp.experts'"):
        DTPPruner(model, inputs, 0.5, budget="global")
    pruner = DTPPruner(model, inputs, {"heads": 0.5}, budget="global")  # experts left whole
    assert not any(isinstance(g, ExpertGroup) for g in pruner.groups)


def test_a_flops_budget_learns_one_ratio_per_block_of_experts():
    """Under budget "flops" the experts of a block share one learned kept ratio, so they
    keep one count whatever theta learns; F(alpha) at the kept counts is the exported
    FLOPs ratio, the penalty reaches every theta and the export is exact."""
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    pruner = randomised(DTPPruner(model, inputs, 0.5, budget="flops"))
    heads_and_blocks = 2 + 2
    assert pruner.theta.shape == (heads_and_blocks,)
    report = pruner.report()
    torch.testing.assert_close(
        pruner.flops_ratio().item(), report["flops_after"] / report["flops_before"]
    )
    pruner.penalty(0.3).backward()
    assert (pruner.theta.grad != 0).all()
    with torch.no_grad():
        pruner.theta.copy_(torch.tensor([0.0, 1.0, -1.0, 2.0]))
    kept = pruner.kept_counts()
    assert kept == [
        round(n * float(torch.sigmoid(torch.tensor(t))))
        for n, t in zip(
            pruner.sizes, [0.0] + [1.0] * EXPERTS + [-1.0] + [2.0] * EXPERTS, strict=True
        )
    ]
    assert [int(m.sum()) for m in pruner.hard_masks()] == kept
    # widths grouped_mm cannot read (not a multiple of 4 in fp32): the export says so
    # and runs its experts with batched_mm; the model pruned keeps its implementation
    assert kept[1] % 4 and model.config._experts_implementation == "grouped_mm"
    with pytest.warns(UserWarning, match=r"'model.layers.0.mlp.experts': 47.*batched_mm"):
        exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert exported.config._experts_implementation == "batched_mm"
    assert model.config._experts_implementation == "grouped_mm"
    assert [layer.mlp.experts.down_proj.shape[2] for layer in exported.model.layers] == [
        kept[1],
        kept[1 + EXPERTS + 1],
    ]


def test_ignored_experts_stay_whole_and_a_model_without_experts_says_so():
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    first = model.model.layers[0].mlp.experts
    pruner = DTPPruner(model, inputs, {"experts": 0.5}, ignored_layers=[first])
    assert {g.module_name for g in pruner.groups} == {"model.layers.1.mlp.experts"}
    pruner.remove()
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SIZES, num_hidden_layers=1, intermediate_size=64)
    )
    with pytest.raises(ValueError, match=r"no group of that kind.*transformers' layout"):
        DTPPruner(llama, (tokens(),), {"experts": 0.5})


@pytest.mark.parametrize("ratios", [{"experts": 0.5}, {"model.layers.1.mlp.experts.*": 0.5}])
def test_experts_prune_where_the_channel_graph_cannot_follow_the_model(ratios):
    """Torch-Pruning's graph fails on DeepSeek-V3's latent attention; heads and experts
    do not need it, so ratios for experts alone prune them: export equal to the
    hard-masked model, counts exact. (Its shared experts are moe_intermediate_size wide
    too, so the config cannot describe the routed experts pruned alone.)"""
    model, inputs = tiny_deepseek(), (tokens(),)
    pruner = randomised(DTPPruner(model, inputs, ratios))
    assert [g.name for g in pruner.groups] == [
        f"model.layers.1.mlp.experts.{e}" for e in range(EXPERTS)
    ]
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert exported.model.layers[1].mlp.experts.down_proj.shape == (EXPERTS, 32, 8)
    params, flops = pruner.predicted_counts()
    assert (params, flops) == (
        sum(p.numel() for p in exported.parameters()),
        count_flops(exported, inputs),
    )


@pytest.mark.parametrize(
    "ratios",
    [0.5, {"experts": 0.5, "channels": 0.5}, {"model.layers.0.self_attn.q_a_proj": 0.5}],
)
def test_ratios_that_need_the_channel_graph_say_it_fails(ratios, monkeypatch):
    """What needs the graph (a float, channels, a layer outside the heads, experts and
    MLPs) raises its failure, naming the model and what works without it: DeepSeek-V3's
    graph, without the workaround for the concatenation Torch-Pruning's width inference
    fails on (test_graph_workarounds.py), fails."""
    from dtp_kernels.pruning import channel_graph

    monkeypatch.setattr(
        channel_graph, "unknown_concat_widths_left_unmapped", contextlib.nullcontext
    )
    model, inputs = tiny_deepseek(), (tokens(),)
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM: Torch-Pruning's.*'mlp' alone"):
        DTPPruner(model, inputs, ratios)
    assert not any(nn.utils.parametrize.is_parametrized(m) for m in model.modules())


def test_a_router_that_is_a_linear_layer_returning_a_tuple_prunes():
    """PhiMoE's router is an nn.Linear whose forward returns (logits, weights, ids):
    Torch-Pruning's trace, which would fail on it, leaves it out
    (test_graph_workarounds.py), and no hook of the trace stays on the model (it would
    fail every later forward); the cost model reads the logits. Dicts of heads and
    experts prune it and export exactly."""
    config = transformers.PhimoeConfig(
        **SIZES, num_hidden_layers=2, intermediate_size=16, num_local_experts=EXPERTS
    )
    torch.manual_seed(0)
    model, inputs = transformers.PhimoeForCausalLM(config), (tokens(),)
    DTPPruner(model, inputs, 0.5).remove()
    assert not any(m._forward_hooks for m in model.modules())
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5, "experts": 0.5}))
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pruner.predicted_counts() == (
        sum(p.numel() for p in exported.parameters()),
        count_flops(exported, inputs),
    )


class ListedExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class ListedExperts(nn.Module):
    """A mixture of experts as research code writes it: a ModuleList of gated MLPs, each
    run on the tokens routed to it (top-1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.router = nn.Linear(4, 8), nn.Linear(8, EXPERTS)
        self.experts = nn.ModuleList(ListedExpert() for _ in range(EXPERTS))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        weight, chosen = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).nonzero().flatten()
            if len(rows):  # only the experts a token was routed to run
                out = out.index_add(0, rows, expert(h[rows]) * weight[rows, None])
        return self.head(h + out)


def test_listed_experts_are_gated_groups_and_unrouted_ones_are_named():
    """Each expert of a ModuleList is a gated MLP group of its own (its own count). An
    expert no example token reaches never runs, so no group can be found for it: the
    pruner warns, naming it, instead of leaving it whole unsaid."""
    torch.manual_seed(0)
    model = ListedExperts()
    many = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pruner = randomised(DTPPruner(model, many, 0.5))
    assert [g.name for g in pruner.groups] == [f"experts.{e}.w1" for e in range(EXPERTS)]
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(many)
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(many), want, rtol=1e-5, atol=1e-6)
    assert [e.w2.in_features for e in exported.experts] == [8] * EXPERTS
    pruner.remove()
    one = many[:1]
    chosen = int(model.router(model.embed(one)).argmax())
    idle = [f"'experts.{e}.w{i}'" for e in range(EXPERTS) if e != chosen for i in (1, 3, 2)]
    with pytest.warns(UserWarning, match=r"9 conv/linear layers were not called") as caught:
        DTPPruner(model, one, 0.5).remove()
    assert all(name in str(caught[0].message) for name in idle[:6])
    left = [m for e, expert in enumerate(model.experts) if e != chosen for m in expert.children()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # layers left whole on purpose are not named
        DTPPruner(model, one, 0.5, ignored_layers=left)


class DenseRoutedExperts(nn.Module):
    """Experts in transformers' layout whose forward gets dense routing weights only (no
    tensor of chosen experts): their FLOPs cannot be counted."""

    has_gate, is_concatenated, is_transposed, has_bias = True, True, False, False

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, 8, 4))
        self.down_proj = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,eoh->eto", x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("eti,ehi->eth", nn.functional.silu(gate) * up, self.down_proj)
        return torch.einsum("eth,te->th", out, weights)


def test_only_weights_whose_shapes_match_the_layout_flags_are_experts():
    """The flags say how to read the weights; a module whose weights contradict them (or
    that lacks 3-D weights) is not taken for experts."""
    assert expert_layout(DenseRoutedExperts()).width == 4
    transposed = DenseRoutedExperts()
    transposed.is_transposed = True  # would read [E, H, 2I] from a [E, 2I, H] weight
    flat, missing = DenseRoutedExperts(), DenseRoutedExperts()
    flat.down_proj = nn.Parameter(torch.randn(4, 8))
    del missing.down_proj
    assert [expert_layout(m) for m in (transposed, flat, missing, nn.Linear(2, 2))] == [None] * 4


def test_experts_whose_routing_cannot_be_read_are_named():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.experts = nn.Linear(4, 2), DenseRoutedExperts()

        def forward(self, x):
            return self.experts(x, self.router(x).softmax(-1))

    with pytest.raises(ValueError, match=r"DenseRoutedExperts got no integer tensor"):
        DTPPruner(Block(), torch.randn(3, 4), {"experts": 0.5})


@pytest.mark.cuda
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_experts_train_and_export_on_the_gpu(implementation):
    """On a GPU, under each experts implementation: a bf16-autocast training step reaches
    every routed expert's scores with finite gradients, and the fp32 export (IEEE
    matmuls) equals the hard-masked model."""
    torch.manual_seed(0)
    model, inputs = moe("Mixtral", **MIXTRAL)
    model.config._experts_implementation = implementation
    model, inputs = model.cuda(), tuple(t.cuda() for t in inputs)
    pruner = randomised(DTPPruner(model, inputs, {"experts": 0.5, "heads": 0.5}))
    grads, exported = bf16_step_and_export(pruner, model, inputs)
    assert torch.isfinite(grads).all() and (grads != 0).any()
    assert exported.model.layers[0].mlp.experts.down_proj.is_cuda
