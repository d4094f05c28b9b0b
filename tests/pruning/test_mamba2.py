"""Mamba-2 mixers' heads (tiny Hugging Face configurations built here, nothing
downloaded): one group per mixer, a head per unit, masked on conv1d's x rows, every group
of heads keeping as many; the export cuts each head's rows, columns and parameters and
rescales the gated norm over its groups, equal to the hard-masked model with exact
counts, generation with the cache too; the hybrids built on the mixer prune with a float
ratio; counts the groups of heads cannot keep alike are refused by name."""

import warnings

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, load_pruned, save_pruned
from dtp_kernels.pruning.mamba2 import Mamba2Group, mamba2_form
from utils import LLAMA_VOCAB as VOCAB
from utils import bf16_step_and_export, causal_lm, hard_masked_and_exported, randomised
from utils import tiny_mamba2 as mamba2

transformers = pytest.importorskip("transformers")

HEADS, HEAD_DIM = 8, 8
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SIZES = dict(vocab_size=VOCAB, hidden_size=32, **TOKEN_IDS)
# the hybrids' Mamba-2 sizes, under their own field names
HYBRID = dict(mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM, mamba_n_groups=2, mamba_d_state=8)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=32)


def tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


# family: (config sizes, the groups a float ratio finds by kind)
HYBRIDS = {
    "NemotronH": (
        dict(
            layers_block_type=["mamba", "attention", "mlp"],
            mamba_num_heads=HEADS,
            mamba_head_dim=HEAD_DIM,
            n_groups=2,
            ssm_state_size=8,
            chunk_size=8,
            head_dim=8,
            mtp_layers_block_type=None,
            **ATTENTION,
        ),
        {"Mamba2Group": 1, "HeadGroup": 1, "ChannelGroup": 1},
    ),
    "Bamba": (
        dict(
            num_hidden_layers=2, attn_layer_indices=[1], mamba_chunk_size=8, **HYBRID, **ATTENTION
        ),
        {"Mamba2Group": 1, "HeadGroup": 1, "ChannelGroup": 2},
    ),
    "GraniteMoeHybrid": (
        dict(
            num_hidden_layers=2,
            layer_types=["mamba", "attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=32,
            mamba_chunk_size=8,
            **HYBRID,
            **ATTENTION,
        ),
        {"Mamba2Group": 1, "HeadGroup": 1, "ChannelGroup": 1, "ExpertGroup": 8},
    ),
    "Zamba2": (
        dict(
            num_hidden_layers=2,
            layers_block_type=["mamba", "hybrid"],
            mamba_headdim=HEAD_DIM,
            mamba_ngroups=2,
            mamba_d_state=8,
            n_mamba_heads=HEADS,
            chunk_size=8,
            attention_head_dim=8,
            num_mem_blocks=1,
            **ATTENTION,
        ),
        {"Mamba2Group": 2, "HeadGroup": 1, "ChannelGroup": 2},
    ),
}


def falcon_h1(rms_norm: bool) -> dict:
    """Falcon-H1: per-projection-row muP multipliers (a buffer), its norm optional."""
    sizes = dict(num_hidden_layers=2, head_dim=8, mamba_d_ssm=64, mamba_chunk_size=8)
    return dict(mamba_rms_norm=rms_norm, **sizes, **HYBRID, **ATTENTION)


HYBRIDS |= {
    f"FalconH1{'-norm' if norm else ''}": (
        falcon_h1(norm),
        {"Mamba2Group": 2, "HeadGroup": 2, "ChannelGroup": 2},
    )
    for norm in (False, True)
}


def hybrid(family: str) -> nn.Module:
    return causal_lm(family.partition("-")[0], {**SIZES, **HYBRIDS[family][0]})


@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_heads_export_exactly_with_the_norm_rescaled(groups):
    """Each mixer keeps exactly its k heads, k / G in each group of heads; the export cuts
    their z, x, B/C-less conv and dt rows, out_proj columns and per-head parameters, and
    rescales the norm (weight by sqrt(N / K), epsilon by N / K, group size K channels),
    equal to the hard-masked model, generation with the cache too; the parameters
    predicted; the config, which holds one epsilon for all norms, is left with a
    warning."""
    model, ids = mamba2(groups), tokens()
    pruner = randomised(DTPPruner(model, (ids,), 0.5))
    assert [type(g).__name__ for g in pruner.groups] == ["Mamba2Group"] * 2
    dense = [
        (layer.mixer.norm.weight.detach().clone(), layer.mixer.norm.variance_epsilon)
        for layer in model.backbone.layers
    ]
    masks = pruner.hard_masks()
    for mask in masks:
        assert [int(part.sum()) for part in mask.view(groups, -1)] == [4 // groups] * groups
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert any("config cannot describe" in str(w.message) for w in caught)
    for layer, mask, (weight, epsilon) in zip(exported.backbone.layers, masks, dense, strict=True):
        mixer, kept = layer.mixer, mask.nonzero().flatten()
        channels = (kept[:, None] * HEAD_DIM + torch.arange(HEAD_DIM)).flatten()
        assert (mixer.num_heads, mixer.intermediate_size) == (4, 32)
        assert mixer.conv1d.weight.shape[0] == 32 + 2 * groups * 8  # B and C whole
        assert mixer.norm.group_size == 32 // groups
        assert mixer.norm.variance_epsilon == pytest.approx(epsilon * 2)
        torch.testing.assert_close(mixer.norm.weight, weight[channels] * 2**0.5)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    with torch.no_grad(), pruner.hard_masked():  # the recurrent path, one token at a time
        want = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    got = exported.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


class WholeGatedNorm(nn.Module):
    """Mamba2's gated RMS norm in transformers 5.17 and earlier: over all of the mixer's
    channels, no group_size."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype, hidden = hidden.dtype, hidden.float()
        if gate is not None:
            hidden = hidden * nn.functional.silu(gate.float())
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


def test_a_norm_over_all_the_mixers_channels_is_rescaled_alike():
    """The same export with the norm of transformers 5.17 (over all channels, every group
    keeping as many heads): exact, its weight and epsilon rescaled as a group's."""
    model, ids = mamba2(2), tokens()
    for layer in model.backbone.layers:
        norm = layer.mixer.norm
        layer.mixer.norm = WholeGatedNorm(norm.weight.numel(), norm.variance_epsilon)
    epsilon = model.backbone.layers[0].mixer.norm.variance_epsilon
    pruner = randomised(DTPPruner(model, (ids,), 0.5))
    assert [type(g).__name__ for g in pruner.groups] == ["Mamba2Group"] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the config cannot describe the rescaled norms
        exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    norm = exported.backbone.layers[0].mixer.norm
    assert norm.weight.shape == (32,) and norm.variance_epsilon == pytest.approx(2 * epsilon)


def test_a_saved_mixer_loads_with_its_rescaled_norm(tmp_path):
    """save_pruned with a builder writes the norm's epsilon with the counts: the loaded
    model computes what the exported one does."""
    model, ids = mamba2(), tokens()
    exported = randomised(DTPPruner(model, (ids,), 0.5)).export().eval()
    path = tmp_path / "mamba2.safetensors"
    save_pruned(path, exported, builder="utils:tiny_mamba2", builder_kwargs={"groups": 2})
    loaded = load_pruned(path).eval()
    norm = loaded.backbone.layers[1].mixer.norm
    assert norm.variance_epsilon == exported.backbone.layers[1].mixer.norm.variance_epsilon
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, exported(ids).logits, rtol=0, atol=0)


def test_the_mask_zeroes_the_heads_x_channels_and_leaves_b_and_c():
    """Under the hard mask the removed heads' x rows of conv1d (weight and bias) are zero
    and every B and C row is as it was; a training step reaches every head's score."""
    model, ids = mamba2(), tokens()
    pruner = randomised(DTPPruner(model, (ids,), 0.5))
    conv = model.backbone.layers[0].mixer.conv1d
    original = conv.parametrizations.weight.original.detach().clone()
    mask = pruner.hard_masks()[0].repeat_interleave(HEAD_DIM)
    with torch.no_grad(), pruner.hard_masked():
        weight = conv.weight
    torch.testing.assert_close(weight[:64], original[:64] * mask[:, None, None])
    torch.testing.assert_close(weight[64:], original[64:])
    model(ids, labels=ids).loss.backward()
    grads = pruner.scores.grad.split(pruner.sizes)
    assert all(torch.isfinite(g).all() and (g != 0).all() for g in grads)


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrids_on_the_mamba2_mixer_prune_with_a_float(family):
    """A float ratio prunes the mixers' heads with the attention heads, MLPs and experts
    (Torch-Pruning's graph fails on the mixers' in_proj: found by form, they are left
    out of it), exported equal to the hard-masked model with the parameters predicted."""
    model, ids = hybrid(family), tokens()
    pruner = randomised(DTPPruner(model, (ids,), 0.5))
    kinds = [type(g).__name__ for g in pruner.groups]
    assert {kind: kinds.count(kind) for kind in kinds} == HYBRIDS[family][1]
    for group, mask in zip(pruner.groups, pruner.hard_masks(), strict=True):
        if isinstance(group, Mamba2Group):
            assert int(mask.sum()) == HEADS // 2
    exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_falcon_h1s_multipliers_are_cut_and_a_builder_file_is_refused(tmp_path):
    """Falcon-H1 scales in_proj's outputs by a buffer (muP multipliers) that its state
    dict leaves out: export cuts it with the rows, and save_pruned with a builder, whose
    file would load the dense one, is refused naming it."""
    model, ids = hybrid("FalconH1"), tokens()
    exported = randomised(DTPPruner(model, (ids,), 0.5)).export()
    mixer = exported.model.layers[0].mamba
    assert mixer.mup_vector.shape[-1] == mixer.in_proj.out_features == 32 + 32 + 32 + 4
    kwargs = {"family": "FalconH1", "sizes": {**SIZES, **HYBRIDS["FalconH1"][0]}}
    with pytest.raises(ValueError, match=r"buffers \['model.layers.0.mamba.mup_vector'"):
        save_pruned(tmp_path / "f", exported, builder="utils:causal_lm", builder_kwargs=kwargs)
    assert not (tmp_path / "f").exists()


def test_counts_the_groups_of_heads_cannot_keep_alike_are_refused_by_name():
    """With 2 groups of 4 heads, 0.125 would keep 7 heads; budget 'global' any count per
    mixer: refused by name, with the ratios that work, before any mask."""
    model, ids = mamba2(groups=2), tokens()
    with pytest.raises(ValueError, match=r"keeps 7 of the 8 heads of Mamba-2 mixer "):
        DTPPruner(model, (ids,), 0.125)
    with pytest.raises(ValueError, match=r"ratios that can: \['0.75', '0.5', '0.25'\]"):
        DTPPruner(model, (ids,), 0.125)
    with pytest.raises(ValueError, match=r"budget = 'global' cannot keep the same number"):
        DTPPruner(model, (ids,), 0.5, budget="global")
    assert not any(nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    pruner = DTPPruner(mamba2(groups=1), (ids,), 0.125, budget="global")  # one group: free
    assert sum(pruner.kept_counts()) == 14


def test_a_mixer_without_the_form_is_not_a_mamba2_group():
    """A Mamba-2 mixer whose norm does not split into its groups is not this form."""
    mixer = mamba2().backbone.layers[0].mixer
    assert mamba2_form(mixer) is not None
    mixer.norm.group_size = 8
    assert mamba2_form(mixer) is None


@pytest.mark.cuda
def test_mamba2_trains_and_exports_on_the_gpu():
    """On a GPU: a bf16-autocast training step reaches every mixer's scores with finite
    gradients, and the fp32 export (IEEE matmuls) equals the hard-masked model."""
    model, inputs = mamba2().cuda(), (tokens().cuda(),)
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    grads, exported = bf16_step_and_export(pruner, model, inputs)
    assert all(torch.isfinite(g).all() and (g != 0).any() for g in grads.split(pruner.sizes))
    assert exported.backbone.layers[0].mixer.conv1d.weight.is_cuda
