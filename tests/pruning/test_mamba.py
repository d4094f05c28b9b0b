"""Mamba mixers' inner channels (tiny Hugging Face configurations built here, nothing
downloaded): one group per mixer, masked on conv1d's rows, exported by cutting every
per-channel row, column and parameter; the export equals the hard-masked model with
exact counts, the config follows, and a mixer that mixes its channels is not grouped.
With the mixers taken as groups, Torch-Pruning's graph follows the rest of Jamba."""

import warnings

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, L1Pruner
from dtp_kernels.pruning.cost import count_flops
from dtp_kernels.pruning.mamba import MambaGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import bf16_step_and_export, hard_masked_and_exported, randomised

transformers = pytest.importorskip("transformers")


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def mamba(family: str) -> nn.Module:
    """Two mixers of 32 inner channels (hidden 16, expand 2), state 4, conv kernel 3."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        state_size=4,
        expand=2,
        time_step_rank=4,
        conv_kernel=3,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def tiny_jamba() -> nn.Module:
    """Mamba, attention, Mamba, attention; dense MLPs and 4 experts alternating."""
    config = transformers.JambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=4,
        mamba_dt_rank=4,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(config)


@pytest.mark.parametrize("family", ["Mamba", "FalconMamba"])
def test_mamba_mixers_export_exactly_the_kept_channels(family, tmp_path):
    """A float ratio makes each mixer a group, with no warning (conv1d and dt_proj, read
    by the mixer rather than called, are pruned, not idle); the export equals the
    hard-masked model and keeps exactly each kept channel's in_proj rows (input and
    gate), conv1d row, x_proj column, dt_proj row, A_log row, D entry and out_proj
    column; parameters, FLOPs and the config follow (save_pretrained round trip)."""
    model, inputs = mamba(family), (tokens(),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pruner = randomised(DTPPruner(model, inputs, 0.5))
    assert [g.name for g in pruner.groups] == [f"backbone.layers.{i}.mixer" for i in (0, 1)]
    assert all(isinstance(g, MambaGroup) and g.size == 32 for g in pruner.groups)
    masks = pruner.hard_masks()
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i, mask in enumerate(masks):
        keep = mask.nonzero().flatten()
        assert len(keep) == 16
        mixer, prefix = exported.backbone.layers[i].mixer, f"backbone.layers.{i}.mixer"
        conv = f"{prefix}.conv1d.parametrizations"
        expected = {
            "in_proj.weight": dense[f"{prefix}.in_proj.weight"][torch.cat([keep, keep + 32])],
            "conv1d.weight": dense[f"{conv}.weight.original"][keep],
            "conv1d.bias": dense[f"{conv}.bias.original"][keep],
            "x_proj.weight": dense[f"{prefix}.x_proj.weight"][:, keep],
            "dt_proj.weight": dense[f"{prefix}.dt_proj.weight"][keep],
            "dt_proj.bias": dense[f"{prefix}.dt_proj.bias"][keep],
            "A_log": dense[f"{prefix}.A_log"][keep],
            "D": dense[f"{prefix}.D"][keep],
            "out_proj.weight": dense[f"{prefix}.out_proj.weight"][:, keep],
        }
        state = mixer.state_dict()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name
        assert mixer.intermediate_size == mixer.conv1d.groups == 16
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs) < pruner.report()["flops_before"]
    assert exported.config.intermediate_size == 16
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, got)


def test_the_mask_trains_through_the_weight_the_mixer_reads():
    """The soft mask scales conv1d's rows and bias as parametrizations (the mixer hands
    the weight to its scan without calling the layer): a loss reaches every channel's
    score."""
    model, inputs = mamba("Mamba"), (tokens(),)
    pruner = DTPPruner(model, inputs, {"mamba": 0.5})
    conv = model.backbone.layers[0].mixer.conv1d
    assert nn.utils.parametrize.is_parametrized(conv, "weight")
    assert nn.utils.parametrize.is_parametrized(conv, "bias")
    model.train()
    model(*inputs, labels=inputs[0]).loss.backward()
    grads = pruner.scores.grad.split(pruner.sizes)
    assert all(torch.isfinite(g).all() and (g != 0).all() for g in grads)


def test_jamba_prunes_mixers_heads_experts_and_mlps_together(tmp_path):
    """With its Mamba mixers taken as groups, Torch-Pruning's graph follows the rest of
    Jamba (its search failed inside the mixer): a float ratio prunes mixers, heads,
    experts and MLPs; the export equals the hard-masked model, counts are exact and the
    config describes it (mamba_expand, heads, intermediate_size)."""
    model, inputs = tiny_jamba(), (tokens(),)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    kinds = {type(g).__name__ for g in pruner.groups}
    assert kinds == {"MambaGroup", "ChannelGroup", "HeadGroup", "ExpertGroup"}
    assert [g.name for g in pruner.groups if isinstance(g, MambaGroup)] == [
        "model.layers.0.mamba",
        "model.layers.2.mamba",
    ]
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params, flops = pruner.predicted_counts()
    assert (params, flops) == (
        sum(p.numel() for p in exported.parameters()),
        count_flops(exported, inputs),
    )
    config = exported.config
    fields = ("mamba_expand", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    assert [getattr(config, f) for f in fields] == [1, 2, 1, 24]
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, got)


def test_a_channels_weights_are_its_input_and_gate_rows_and_its_output_column():
    """What magnitude scores read per channel j: in_proj rows j and I + j and out_proj
    column j (L1Pruner keeps the channels of largest L1 norm of those)."""
    model, inputs = mamba("Mamba"), (tokens(),)
    mixer = model.backbone.layers[1].mixer
    pruner = L1Pruner(model, inputs, {"mamba": 0.5})
    rows = mixer.in_proj.weight.detach().abs().sum(1)
    l1 = rows[:32] + rows[32:] + mixer.out_proj.weight.detach().abs().sum(0)
    want = torch.zeros(32)
    want[l1.topk(16).indices] = 1
    assert torch.equal(pruner.hard_masks()[1], want)


class Mixer(nn.Module):
    """A Mamba mixer's layers and parameters around a simple scan per channel; `rolled`
    shifts the channels by one before out_proj (each then depends on its neighbour)."""

    def __init__(self, rolled: bool) -> None:
        super().__init__()
        self.rolled = rolled
        self.in_proj, self.out_proj = nn.Linear(8, 2 * 12), nn.Linear(12, 8)
        self.conv1d = nn.Conv1d(12, 12, 3, groups=12, padding=2)
        self.x_proj, self.dt_proj = nn.Linear(12, 2 + 2 * 4, bias=False), nn.Linear(2, 12)
        self.A_log, self.D = nn.Parameter(torch.randn(12, 4)), nn.Parameter(torch.randn(12))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x, z = self.in_proj(h).chunk(2, dim=-1)
        x = nn.functional.silu(self.conv1d(x.transpose(1, 2))[..., : h.shape[1]]).transpose(1, 2)
        dt = nn.functional.softplus(self.dt_proj(self.x_proj(x)[..., :2]))
        y = x * (dt * self.A_log.exp().sum(-1) + self.D)
        if self.rolled:
            y = y.roll(1, dims=-1)
        return self.out_proj(y * nn.functional.silu(z))


@pytest.mark.parametrize("rolled", [False, True])
def test_a_mixer_is_grouped_only_when_its_channels_cut_exactly(rolled):
    """A module with the mixer's form is grouped when removing channels equals masking
    them on its example input; one that mixes its channels is not (no group of that
    kind)."""
    torch.manual_seed(0)
    model, x = Mixer(rolled), torch.randn(2, 5, 8)
    if rolled:
        with pytest.raises(ValueError, match=r"no group of that kind"):
            DTPPruner(model, x, {"mamba": 0.5})
        return
    pruner = randomised(DTPPruner(model, x, {"mamba": 0.5}))
    assert [type(g).__name__ for g in pruner.groups] == ["MambaGroup"]
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-6)
    assert exported.conv1d.weight.shape == (6, 1, 3)


@pytest.mark.cuda
def test_jamba_trains_and_exports_on_the_gpu():
    """On a GPU: a bf16-autocast training step of Jamba reaches every mixer's scores with
    finite gradients, and the fp32 export (IEEE matmuls) equals the hard-masked model."""
    model, inputs = tiny_jamba().cuda(), (tokens().cuda(),)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    grads, exported = bf16_step_and_export(pruner, model, inputs)
    grads = grads.split(pruner.sizes)
    mixers = [
        g for g, group in zip(grads, pruner.groups, strict=True) if isinstance(group, MambaGroup)
    ]
    assert len(mixers) == 2
    assert all(torch.isfinite(g).all() and (g != 0).any() for g in mixers)
    assert exported.model.layers[0].mamba.conv1d.weight.is_cuda
