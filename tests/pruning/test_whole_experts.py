"""Whole experts of mixture-of-experts blocks (tiny Hugging Face configurations built
here, nothing downloaded): kind "whole_experts" learns which experts each block keeps
through log(mask) on the router's logits; the export removes the others from the router
and the experts' 3-D parameters, equals the hard-masked model with exact counts, and the
config follows. Routers whose choice the mask cannot reach are refused by name."""

import warnings

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, L1Pruner
from dtp_kernels.pruning.experts import expert_layout
from dtp_kernels.pruning.whole_experts import MaskedRouting, WholeExpertsGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import bf16_step_and_export, hard_masked_and_exported, randomised, tiny_deepseek

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K = 8, 2
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    num_experts_per_tok=TOP_K,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# family -> its sizes (EXPERTS experts of TOP_K per token) and the config's count field
FAMILIES = {
    "Mixtral": (dict(intermediate_size=32, num_local_experts=EXPERTS), "num_local_experts"),
    "Qwen3Moe": (  # softmax, then the top-k renormalised
        dict(intermediate_size=32, moe_intermediate_size=16, num_experts=EXPERTS, head_dim=8),
        "num_experts",
    ),
    "Qwen2Moe": (  # beside a shared expert, top-k not renormalised
        dict(
            intermediate_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=EXPERTS,
        ),
        "num_experts",
    ),
    "Olmoe": (
        dict(intermediate_size=16, num_experts=EXPERTS, num_key_value_heads=4),
        "num_experts",
    ),
    "GptOss": (  # top-k of biased logits, then softmax over them
        dict(
            intermediate_size=16,
            num_local_experts=EXPERTS,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "num_local_experts",
    ),
    "Phimoe": (dict(intermediate_size=16, num_local_experts=EXPERTS), "num_local_experts"),
    "Glm4Moe": (  # sigmoid scores and a correction bias added to them for the choice
        dict(
            intermediate_size=32,
            moe_intermediate_size=16,
            n_routed_experts=EXPERTS,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            head_dim=8,
        ),
        "n_routed_experts",
    ),
    "MiniMaxM2": (  # the block hands its router the correction bias
        dict(intermediate_size=16, num_local_experts=EXPERTS, head_dim=8),
        "num_local_experts",
    ),
}


def tokens(seed: int = 1, length: int = 16) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def moe(family: str) -> nn.Module:
    sizes, _ = FAMILIES[family]
    config = getattr(transformers, f"{family}Config")(**{**SIZES, **sizes})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():  # learned per-expert vectors: routers' biases, correction biases
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "bias" in name and tensor.shape == (EXPERTS,):
                tensor.copy_(torch.randn(EXPERTS, generator=torch.Generator().manual_seed(2)))
    return model


def pruner_for(model, ratios, **options) -> DTPPruner:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experts no example token reached stay whole
        return DTPPruner(model, (tokens(),), ratios, **options)


def train(model, pruner, steps: int = 3) -> None:
    optimizer = torch.optim.SGD([*model.parameters(), *pruner.parameters()], lr=0.5)
    pruner.attach(optimizer)
    model.train()
    for _ in range(steps):
        model(tokens(), labels=tokens()).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_experts_train_and_export_exactly(family):
    model = moe(family)
    pruner = randomised(pruner_for(model, {"whole_experts": 0.5}))
    groups = [g for g in pruner.groups if isinstance(g, WholeExpertsGroup)]
    assert groups and len(groups) == len(pruner.groups)
    before = pruner.scores.detach().clone()
    train(model, pruner)
    assert not torch.equal(pruner.scores.detach(), before)  # the logits' mask has a gradient
    masks = pruner.hard_masks()
    exported, got, want = hard_masked_and_exported(pruner, model, (tokens(),))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    modules = dict(exported.named_modules())
    names = {m: n for n, m in model.named_modules()}
    for group, mask in zip(groups, masks, strict=True):
        assert int(mask.sum()) == EXPERTS // 2
        layout = expert_layout(modules[group.name])
        assert layout.experts == EXPERTS // 2
        router = modules[names[group.router]]
        assert router.weight.shape[0] == EXPERTS // 2
        kept = mask.nonzero().flatten()
        torch.testing.assert_close(router.weight, group.router.weight[kept])
        original = getattr(group.experts, group.layout.up)
        torch.testing.assert_close(getattr(modules[group.name], layout.up), original[kept])
    assert pruner.predicted_counts()[0] == sum(p.numel() for p in exported.parameters())
    assert getattr(exported.config, FAMILIES[family][1]) == EXPERTS // 2
    # a model built from the config loads the exported weights and computes the same
    rebuilt = type(exported)(exported.config).eval()
    rebuilt.load_state_dict(exported.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens()).logits, got)


def test_soft_mask_scales_each_experts_routing_probability():
    """softmax(l + log m) = m softmax(l) / sum: the top-k weights of Mixtral's router under
    a soft mask are those of the mask times the unmasked probabilities, renormalised."""
    model = moe("Mixtral")
    pruner = pruner_for(model, {"whole_experts": 0.25})
    group = pruner.groups[0]
    router, index = group.router, 0
    mask = torch.linspace(0.1, 1.0, EXPERTS)
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    pruner._source.hard = [mask, mask]
    try:
        _, weights, chosen = router(hidden)
    finally:
        pruner._source.hard = None
    probs = torch.softmax(hidden @ router.weight.t(), dim=-1) * mask
    top, expected = probs.topk(TOP_K, dim=-1)
    assert torch.equal(chosen, expected)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    assert isinstance(router.forward, MaskedRouting) and index == 0


def test_a_float_or_a_pattern_leaves_whole_experts_alone_a_name_reaches_them():
    model = moe("Mixtral")
    pruner = pruner_for(model, 0.5)
    kinds = {type(g).__name__ for g in pruner.groups}
    assert "WholeExpertsGroup" not in kinds and "ExpertGroup" in kinds
    with pytest.raises(ValueError, match=r"already carries a pruner's masks"):
        pruner_for(model, {"whole_experts": 0.5})
    pruner.remove()
    pruner = pruner_for(model, {"model.layers.*": 0.5})
    assert not any(isinstance(g, WholeExpertsGroup) for g in pruner.groups)
    pruner.remove()
    pruner = pruner_for(model, {"model.layers.1.mlp.experts": 0.25})
    assert [g.name for g in pruner.groups] == ["model.layers.1.mlp.experts"]
    assert pruner.kept == [6]


def test_remove_gives_the_router_its_forward_back():
    model = moe("Qwen3Moe")
    router = model.model.layers[0].mlp.gate
    pruner = pruner_for(model, {"whole_experts": 0.5})
    assert isinstance(router.forward, MaskedRouting)
    exported = pruner.export()
    assert not any("forward" in vars(m) for m in exported.modules())
    pruner.remove()
    assert "forward" not in vars(router)


def test_l1_baseline_removes_whole_experts():
    model = moe("Mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruner = L1Pruner(model, (tokens(),), {"whole_experts": 0.5})
    exported = pruner.export()
    assert exported.config.num_local_experts == EXPERTS // 2
    assert exported.num_experts == EXPERTS // 2  # the load-balancing loss reads it
    exported.train()
    exported(tokens(), labels=tokens(), output_router_logits=True).loss.backward()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(ratios={"whole_experts": 0.8}), r"keeps 1 of the 8 experts .* fewer than the 2"),
        (dict(ratios={"whole_experts": 0.5}, budget="global"), r"budget = 'global' cannot"),
        (dict(ratios={"whole_experts": 0.5}, budget="flops"), r"budget = 'flops' cannot"),
        (dict(ratios={"whole_experts": 0.5, "experts": 0.5}), r"prune one of the two per block"),
        (dict(ratios={"*.experts": 0.5}), r"match no prunable layer"),
    ],
)
def test_what_cannot_be_held_is_refused_before_any_mask(options, message):
    model = moe("Mixtral")
    ratios = options.pop("ratios")
    with pytest.raises(ValueError, match=message):
        pruner_for(model, ratios, **options)
    assert not any(isinstance(vars(m).get("forward"), MaskedRouting) for m in model.modules())


GROUPED = 16  # experts in 4 groups of 4 (group-limited routing)


def grouped(family: str, top_k: int = 4, topk_group: int = 2) -> nn.Module:
    """A causal LM of `family` whose MoE blocks route each token to `top_k` of 16 experts
    within its `topk_group` best of 4 groups of experts; learned correction biases."""
    sizes = dict(
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=GROUPED,
        num_experts_per_tok=top_k,
        n_group=4,
        topk_group=topk_group,
        first_k_dense_replace=0,
        head_dim=8,
    )
    if family in ("DeepseekV3", "Mistral4"):
        del sizes["head_dim"]  # latent attention, as tiny_deepseek's
        sizes.update(num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=12)
        sizes.update(qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
    if family == "Dots1":
        sizes.update(n_shared_experts=1)
    config = getattr(transformers, f"{family}Config")(**{**SIZES, **sizes})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "correction_bias" in name:
                buffer.copy_(torch.randn(GROUPED, generator=torch.Generator().manual_seed(2)))
    return model


@pytest.mark.parametrize("family", ["DeepseekV3", "Glm4Moe", "Dots1", "Mistral4"])
def test_group_limited_routing_keeps_the_same_count_in_every_group(family):
    """DeepSeek-V3, GLM-4.5, Dots1 (sigmoid scores and a correction bias) and Mistral 4
    (softmax) route each token within its best groups of experts (a group's score: the
    sum of its best two). Every group keeping the same count, the cut
    router's groups are the old groups' kept experts: one transport segment per group of
    experts, each keeping its share, and the export equals the hard-masked model."""
    model = grouped(family)
    pruner = randomised(pruner_for(model, {"whole_experts": 0.5}))
    blocks = len(pruner.groups)
    assert blocks == 2 and pruner.state.sizes == (4,) * 4 * blocks
    assert pruner.current_keep().tolist() == [2.0] * 4 * blocks
    train(model, pruner)
    with torch.no_grad():
        soft = pruner._transport(update=False)
    torch.testing.assert_close(soft.view(-1, 4).sum(1), torch.full((4 * blocks,), 2.0))
    masks = pruner.hard_masks()
    for mask in masks:  # two of every group of four
        assert mask.view(4, 4).sum(1).tolist() == [2.0] * 4
    exported, got, want = hard_masked_and_exported(pruner, model, (tokens(),))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert exported.config.n_routed_experts == GROUPED // 2 and exported.config.n_group == 4
    names = {m: n for n, m in model.named_modules()}
    for group, mask in zip(pruner.groups, masks, strict=True):
        router = exported.get_submodule(names[group.router])
        assert router.num_experts == GROUPED // 2 and router.num_group == 4
        kept = mask.nonzero().flatten()
        torch.testing.assert_close(router.weight, group.router.weight[kept])
        if family != "Mistral4":  # the others add a correction bias for the choice
            torch.testing.assert_close(
                router.e_score_correction_bias, group.router.e_score_correction_bias[kept]
            )
    assert pruner.predicted_counts()[0] == sum(p.numel() for p in exported.parameters())
    rebuilt = type(exported)(exported.config).eval()
    rebuilt.load_state_dict(exported.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens()).logits, got)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        l1 = L1Pruner(grouped(family), (tokens(),), {"whole_experts": 0.25})
    assert all(m.view(4, 4).sum(1).tolist() == [3.0] * 4 for m in l1.hard_masks())


@pytest.mark.parametrize(
    ("top_k", "topk_group", "ratio", "message"),
    [
        (
            4,
            2,
            0.3,
            r"keeps 11 of the 16 .* multiple of 4; the nearest ratios that give one: "
            r"0.5 \(keeps 8\), 0.25 \(keeps 12\)",
        ),
        (4, 2, 0.75, r"keeps 1 of the 4 experts of each .* among 2 groups .* keep at least 8"),
        # a group's score is the sum of its best two: one kept per group cannot give it
        (
            2,
            2,
            0.75,
            r"whole experts of 'model.layers.0.mlp.experts': .* keeping 1 of each "
            r"of its 4 groups of experts",
        ),
    ],
)
def test_group_limited_counts_that_cannot_hold_are_refused(top_k, topk_group, ratio, message):
    model = grouped("DeepseekV3", top_k, topk_group)
    with pytest.raises(ValueError, match=message):
        pruner_for(model, {"whole_experts": ratio})
    assert not any(isinstance(vars(m).get("forward"), MaskedRouting) for m in model.modules())


def test_two_experts_per_group_cannot_lose_any():
    """4 experts in 2 groups: half a group is one expert, less than a group's score takes."""
    model = tiny_deepseek()
    gate = model.model.layers[1].mlp.gate
    model.config.n_group = model.config.topk_group = gate.num_group = gate.topk_group = 2
    with pytest.raises(ValueError, match=r"whole experts of 'model.layers.1.mlp.experts': its"):
        pruner_for(model, {"whole_experts": 0.5})


def test_hash_routing_is_refused_by_name():
    """DeepSeek-V4's first layers choose experts from a token-id table: the mask on the
    logits cannot keep a removed expert from being chosen."""
    config = transformers.DeepseekV4Config(
        **{**SIZES, "num_key_value_heads": 1},
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=EXPERTS,
        head_dim=8,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config)  # its table sends every token to 0
    with pytest.raises(ValueError, match=r"its router \(DeepseekV4HashRouter\)"):
        pruner_for(model, {"whole_experts": 0.5})


def test_a_correction_bias_the_mask_does_not_reach_is_refused_by_name():
    """Ernie 4.5 adds its correction bias in a submodule of the router (moe_statics), out
    of the mask's reach: a removed expert with a large bias would still be chosen."""
    config = transformers.Ernie4_5_MoeConfig(
        **SIZES, intermediate_size=32, moe_intermediate_size=16, moe_num_experts=EXPERTS
    )
    torch.manual_seed(0)
    model = transformers.Ernie4_5_MoeForCausalLM(config)
    with pytest.raises(ValueError, match=r"its router \(Ernie4_5_MoeTopKRouter\)"):
        pruner_for(model, {"whole_experts": 0.5})


class Experts(nn.Module):
    """EXPERTS gated experts in transformers' layout (the flags it sets)."""

    has_gate, is_concatenated, is_transposed, has_bias = True, True, False, False

    def __init__(self, hidden: int = 8, width: int = 4) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, hidden, width))

    def forward(self, hidden, chosen, weights):
        out = torch.zeros_like(hidden)
        for slot in range(chosen.shape[1]):
            gate, up = torch.einsum("th,tih->ti", hidden, self.gate_up_proj[chosen[:, slot]]).chunk(
                2, -1
            )
            down = torch.einsum(
                "ti,thi->th", nn.functional.silu(gate) * up, self.down_proj[chosen[:, slot]]
            )
            out = out + weights[:, slot, None] * down
        return out


class SigmoidRouter(nn.Module):
    """Sigmoid scores; the choice adds a correction bias: its own, or the block's."""

    def __init__(self, added: str, hidden: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, hidden))
        self.correction = nn.Parameter(torch.zeros(EXPERTS))
        self.top_k, self.added = TOP_K, added

    def forward(self, hidden, handed=None):
        scores = nn.functional.linear(hidden, self.weight).sigmoid()
        if self.added == "own":  # the sum the mask joins
            choice = scores + self.correction
        elif self.added == "own, scaled":  # a new tensor: out of the mask's reach
            choice = scores + 1.0 * self.correction
        else:  # the block's, scaled
            choice = scores + 1.0 * handed
        chosen = choice.topk(self.top_k, dim=-1).indices
        return scores, scores.gather(1, chosen), chosen


class Block(nn.Module):
    def __init__(self, added: str) -> None:
        super().__init__()
        self.gate, self.experts = SigmoidRouter(added), Experts()
        self.handed = nn.Parameter(torch.zeros(EXPERTS))

    def forward(self, hidden):
        if self.gate.added == "handed":
            _, weights, chosen = self.gate(hidden, self.handed)
        else:
            _, weights, chosen = self.gate(hidden)
        return self.experts(hidden, chosen, weights)


@pytest.mark.parametrize("added", ["own", "own, scaled", "handed"])
def test_a_correction_bias_is_masked_where_the_choice_adds_it_else_refused(added):
    """The mask joins a sum with the router's own per-expert vector (GLM-4.5's correction
    bias); a bias added as a new tensor is out of its reach, and the proof, run with the
    vector favouring the removed experts, refuses the router by name."""
    torch.manual_seed(0)
    block, hidden = Block(added), torch.randn(32, 8)
    if added != "own":
        with pytest.raises(ValueError, match=r"whole experts of 'experts': its router"):
            DTPPruner(block, hidden, {"whole_experts": 0.5})
        return
    pruner = randomised(DTPPruner(block, hidden, {"whole_experts": 0.5}))
    with torch.no_grad():
        block.gate.correction.copy_(torch.randn(EXPERTS) * 3)
        with pruner.hard_masked():
            want = block(hidden)
        exported = pruner.export()
        got = exported(hidden)
    torch.testing.assert_close(got, want)
    # the block's per-expert parameter goes with the router's and the experts'
    assert pruner.predicted_counts()[0] == sum(p.numel() for p in exported.parameters())


@pytest.mark.slow
def test_the_masked_router_compiles_without_graph_breaks():
    """The router's masked forward (a TorchFunctionMode around it) traces into one graph
    under torch.compile: the loss and the scores' gradients equal eager's."""
    from torch._dynamo.utils import counters

    model = moe("Mixtral")
    pruner = randomised(pruner_for(model, {"whole_experts": 0.5}))
    model.train()
    losses, grads = [], []
    torch._dynamo.reset()
    counters.clear()
    for run in (model, torch.compile(model)):
        loss = run(tokens(), labels=tokens()).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(pruner.scores.grad.clone())
        pruner.scores.grad = None
    assert not counters["graph_break"]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)
    assert grads[0].abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["Qwen3Moe", "Glm4Moe"])
def test_whole_experts_train_and_export_on_the_gpu(family):
    """On a GPU: a bf16-autocast training step reaches every block's expert scores with
    finite gradients, and the fp32 export (IEEE matmuls) equals the hard-masked model."""
    model = moe(family).cuda()
    inputs = (tokens().cuda(),)
    pruner = randomised(DTPPruner(model, inputs, {"whole_experts": 0.5, "heads": 0.5}))
    grads, exported = bf16_step_and_export(pruner, model, inputs)
    assert torch.isfinite(grads).all() and (grads != 0).any()
    assert expert_layout(exported.model.layers[0].mlp.experts).experts == EXPERTS // 2
