"""MLP modules found by their form where Torch-Pruning's graph cannot follow the model:
the modules whose hidden neurons cut exactly are grouped (gated and plain, in any
registration order), those that mix their neurons are not, the export equals the
hard-masked model with exact counts, and on the models the graph fails on (DeepSeek-V3,
DeepSeek-V2; tiny configurations built here) heads, experts and MLPs prune together and
the config describes the result."""

import contextlib

import pytest
import torch
import torch_pruning as tp
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops
from dtp_kernels.pruning.mlps import FormMLPGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import hard_masked_and_exported, randomised, tiny_deepseek


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
        self.down_proj = nn.Linear(12, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DownFirst(nn.Module):
    """A plain MLP whose down projection is registered before its up projection."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = nn.Linear(10, 8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Softmaxed(nn.Module):
    """A softmax over the hidden neurons: each depends on all the others."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 10), nn.Linear(10, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).softmax(-1))


class Rolled(nn.Module):
    """The hidden neurons shifted by one: neuron j feeds the consumer's column j + 1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 10), nn.Linear(10, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)).roll(1, -1))


class Normed(nn.Module):
    """A LayerNorm over the hidden neurons: not the form (a parameter outside the linears)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 10), nn.LayerNorm(10), nn.Linear(10, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)))


class Scaled(nn.Module):
    """A parameter of its own beside the linears: not the form (whatever it computes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 10), nn.Linear(10, 8)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(
            [Gated(), DownFirst(), Softmaxed(), Rolled(), Normed(), Scaled()]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


FOUND = ["blocks.0.gate_proj", "blocks.1.up"]


@pytest.fixture
def graph_fails(monkeypatch):
    """Torch-Pruning's DependencyGraph fails on every model, as it does on DeepSeek-V3."""

    def fail(*_args, **_kwargs):
        raise RuntimeError("cannot follow this model")

    monkeypatch.setattr(tp.DependencyGraph, "build_dependency", fail)


def test_mlps_that_cut_exactly_are_found_and_export_their_kept_neurons(graph_fails):
    """Without the graph, the gated MLP and the plain one (down projection registered
    first) are groups; the softmaxed, rolled, normed and scaled ones are not. The export equals
    the hard-masked model, keeps exactly the kept neurons (producers' rows, consumer's
    columns), and parameters and FLOPs are as predicted."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    pruner = randomised(DTPPruner(model, x, {"mlp": 0.5}))
    assert [g.name for g in pruner.groups] == FOUND
    assert all(isinstance(g, FormMLPGroup) for g in pruner.groups)
    masks = pruner.hard_masks()
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-6)
    gated, plain = exported.blocks[0], exported.blocks[1]
    kept = [m.nonzero().flatten() for m in masks]
    assert [len(k) for k in kept] == [6, 5]
    for name in ("gate_proj", "up_proj"):
        want_rows = dense[f"blocks.0.{name}.weight"][kept[0]]
        assert torch.equal(getattr(gated, name).weight, want_rows)
    down = dense["blocks.0.down_proj.parametrizations.weight.original"]
    assert torch.equal(gated.down_proj.weight, down[:, kept[0]])
    assert torch.equal(plain.up.bias, dense["blocks.1.up.bias"][kept[1]])
    assert (plain.up.out_features, plain.down.in_features) == (5, 5)
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, (x,)) < pruner.report()["flops_before"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_proof_tells_the_same_modules_apart_in_half_precision(graph_fails, dtype):
    """A model held in half precision (as LLMs are loaded): its outputs round to the
    dtype, and the proof allows the dtype's rounding, so the same MLPs are found and the
    same mixing ones are not."""
    torch.manual_seed(0)
    model = Blocks().to(dtype)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert [g.name for g in DTPPruner(model, x, {"mlp": 0.5}).groups] == FOUND


def test_the_proof_holds_one_copy_of_a_module_at_a_time(graph_fails, monkeypatch):
    """Each proof copies its module once (zeroed and run, then cut and run): an attention
    layer of a 70B model is hundreds of MB, two copies at once twice that."""
    import dtp_kernels.pruning.mlps as mlps
    import dtp_kernels.pruning.proof as proof

    copies, per_proof = [], []
    deepcopy, prove = proof.copy.deepcopy, mlps.cuts_exactly

    def counted_copy(module, *args):
        copies.append(module)
        return deepcopy(module, *args)

    def counted_proof(*args, **kwargs):
        before = len(copies)
        proven = prove(*args, **kwargs)
        per_proof.append(len(copies) - before)
        return proven

    monkeypatch.setattr(proof.copy, "deepcopy", counted_copy)
    monkeypatch.setattr(mlps, "cuts_exactly", counted_proof)
    torch.manual_seed(0)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    assert [g.name for g in DTPPruner(Blocks(), x, {"mlp": 0.5}).groups] == FOUND
    assert len(per_proof) >= 4 and set(per_proof) == {1}


def test_form_mlps_train_through_the_consumers_columns(graph_fails):
    """The soft mask scales the consumer's columns: a loss reaches every group's scores."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    pruner = DTPPruner(model, x, {"mlp": 0.5})
    model(x).square().sum().backward()
    grads = pruner.scores.grad.split(pruner.sizes)
    assert all(torch.isfinite(g).all() and (g != 0).all() for g in grads)
    assert nn.utils.parametrize.is_parametrized(model.blocks[0].down_proj, "weight")
    assert nn.utils.parametrize.is_parametrized(model.blocks[1].down, "weight")


def test_what_needs_the_graph_still_raises_its_failure_and_ignored_mlps_stay(graph_fails):
    """A float, a kind the form does not find ("channels") or a layer outside the groups
    found without the graph raise the graph's failure before any mask; ignored layers
    keep their MLP whole."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(16, 4)
    for ratios in (0.5, {"channels": 0.5}, {"blocks.2.fc1": 0.5}):
        with pytest.raises(ValueError, match=r"Blocks: Torch-Pruning's.*'mlp' alone"):
            DTPPruner(model, x, ratios)
        assert not any(nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    pruner = DTPPruner(model, x, {"mlp": 0.5}, ignored_layers=[model.blocks[1].down])
    assert [g.name for g in pruner.groups] == FOUND[:1]


transformers = pytest.importorskip("transformers")


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


# builder -> (kinds in order, config fields after pruning half of each, where the first
# dense MLP is)
MODELS = {
    "deepseek_v3": (
        tiny_deepseek,
        ["heads", "mlp", "heads", *["experts"] * 4, "mlp"],
        {"intermediate_size": 32, "moe_intermediate_size": 8, "num_attention_heads": 2},
        "model.layers.0.mlp",
    ),
}


@pytest.mark.parametrize("name", MODELS)
def test_heads_experts_and_mlps_prune_where_the_graph_fails(name, tmp_path, monkeypatch):
    """On models Torch-Pruning's graph fails on (DeepSeek's, without the workaround for
    the concatenation its width inference fails on: test_graph_workarounds.py), heads,
    experts and MLPs (dense and shared experts) prune together: the export equals the
    hard-masked model, counts are exact, and the config describes it (save_pretrained /
    from_pretrained)."""
    from dtp_kernels.pruning import channel_graph

    monkeypatch.setattr(
        channel_graph, "unknown_concat_widths_left_unmapped", contextlib.nullcontext
    )
    build, kinds, fields, mlp = MODELS[name]
    model, inputs = build(), (tokens(),)
    with pytest.raises(ValueError, match=r"Torch-Pruning"):
        DTPPruner(model, inputs, 0.5)
    pruner = randomised(DTPPruner(model, inputs, {"heads": 0.5, "experts": 0.5, "mlp": 0.5}))
    assert [type(g).__name__ for g in pruner.groups] == [
        {"heads": "HeadGroup", "experts": "ExpertGroup", "mlp": "FormMLPGroup"}[k] for k in kinds
    ]
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs)
    # the layers left whole say the graph failed, or why their forms keep them
    whole = pruner.left_whole
    assert whole["lm_head"].startswith("Torch-Pruning's channel graph fails on the model")
    assert all(
        why.startswith(("Torch-Pruning's", "a latent attention's")) for why in whole.values()
    )
    assert {k: getattr(exported.config, k) for k in fields} == fields
    width = fields["intermediate_size"]  # the module's own width attribute follows
    assert exported.get_submodule(mlp).intermediate_size == width
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, got)
