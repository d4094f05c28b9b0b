"""MLPs with an RMS norm over their hidden width (BitNet's `ffn_sub_norm`), which
Torch-Pruning's graph leaves out: found by their form, masked on the rows of the
producer the norm reads linearly (proven: not the gate through its activation), cut and
rescaled at export to compute exactly what the hard-masked model computes; a norm that
does not rescale (weight read as 1 + w) or a LayerNorm keeps the MLP whole."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.mlps import FormMLPGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import hard_masked_and_exported, random_params, randomised, tiny_bitnet

transformers = pytest.importorskip("transformers")


class OnePlusRMSNorm(nn.RMSNorm):
    """Gemma's form: the weight read as 1 + w, which no rescaling of w keeps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, (x.shape[-1],), 1 + self.weight, self.eps)


class L2Norm(nn.Module):
    """Dory's: each token's hidden vector to norm 1, no parameters (a sum over the
    channels in the traced graph)."""

    def __init__(self, _width: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class NormedMLP(nn.Module):
    """down(norm(act(gate(x)) * up(x))), the gate registered after up (so the proof, not
    the order, picks the rows the norm reads)."""

    def __init__(self, norm: type[nn.Module] = nn.RMSNorm, bias: bool = True) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(8, 12, bias=bias), nn.Linear(8, 12, bias=bias)
        self.norm, self.down = norm(12), nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(nn.functional.silu(self.gate(x)) * self.up(x)))


class Net(nn.Module):
    """The MLP in a residual block: its hidden width is the one group."""

    def __init__(self, norm: type[nn.Module] = nn.RMSNorm, bias: bool = True) -> None:
        super().__init__()
        self.stem, self.mlp, self.head = nn.Linear(8, 8), NormedMLP(norm, bias), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(x + self.mlp(x))


@pytest.mark.parametrize("bias", [True, False])
def test_the_rows_the_norm_reads_take_the_mask_and_export_is_exact(bias):
    torch.manual_seed(0)
    model, x = random_params(Net(bias=bias), "norm"), torch.randn(6, 8)
    pruner = DTPPruner(model, (x[:1],), {"mlp": 0.5})
    (group,) = pruner.groups
    assert isinstance(group, FormMLPGroup) and group.norm is model.mlp.norm
    assert group.norm_rows is model.mlp.up and pruner.kept == [6]
    model.train()
    model(x).square().mean().backward()
    assert torch.all(pruner.scores.grad != 0)
    randomised(pruner)
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        hard = model.mlp.up(x)  # the mask is on up's rows: zero there
        want = model(x)
    assert (hard == 0).all(0).sum() == 6
    exported = pruner.export().eval()
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert exported.mlp.norm.weight.shape == (6,)
    assert count_params(exported) == pruner.report()["params_after"]


@pytest.mark.parametrize("norm", [OnePlusRMSNorm, nn.LayerNorm], ids=["one-plus-w", "layernorm"])
def test_an_mlp_through_a_norm_that_does_not_rescale_stays_whole(norm):
    model, x = Net(norm), torch.randn(6, 8)
    with pytest.raises(ValueError, match="no group of that kind"):
        DTPPruner(model, (x[:1],), {"mlp": 0.5})


def test_a_gated_mlp_through_a_sum_over_its_neurons_stays_whole():
    """Masked on the down projection's columns, a removed neuron would still count in the
    L2 norm between: the graph's gated group is not taken (Dory's MLPs)."""
    model, x = Net(L2Norm), torch.randn(6, 8)
    with pytest.raises(ValueError, match="no group of that kind"):
        DTPPruner(model, (x[:1],), {"mlp": 0.5})


def test_bitnet_mlps_prune_export_exactly_and_round_trip(tmp_path):
    """Its MLPs alone: the config describes the export (its heads: test_head_norms.py)."""
    model, ids = tiny_bitnet(), torch.randint(0, VOCAB, (2, 8), generator=torch.Generator())
    pruner = randomised(DTPPruner(model, (ids[:1],), {"mlp": 0.5}))
    names = [(g.name, g.norm_rows) for g in pruner.groups]
    mlps = [layer.mlp for layer in model.model.layers]
    assert names == [(f"model.layers.{i}.mlp.gate_proj", m.up_proj) for i, m in enumerate(mlps)]
    assert pruner.kept == [32, 32]
    exported, got, want = hard_masked_and_exported(pruner, model, (ids,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
    assert exported.config.intermediate_size == 32
    exported.save_pretrained(tmp_path)
    loaded = transformers.BitNetForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, got, rtol=1e-5, atol=1e-5)
