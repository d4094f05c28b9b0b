"""The export check of a half-precision model: rounding that parts the exported model's
outputs from the hard-masked model's by more than the half-precision tolerance (a deep
bfloat16 LLM's, whose export sums over fewer terms) is told from a wrong export by the
same weights run in float32; the model keeps its dtypes and parameters."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, base, proof
from dtp_kernels.pruning import pruner as pruner_module
from dtp_kernels.pruning.base import ExportMismatchError
from dtp_kernels.pruning.precision import float32_weights
from utils import randomised

transformers = pytest.importorskip("transformers")


def bf16_llama():
    """A bfloat16 Llama wide enough (MLPs of 4096) that its export's shorter sums round
    apart from the hard-masked model's on the CPU."""
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model, (torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)),)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def strict_bf16(monkeypatch) -> None:
    """No difference allowed in bfloat16 (after the pruner is made: its proofs keep the
    tolerance): any rounding difference fails the first check."""
    monkeypatch.setitem(proof.TOLERANCES, torch.bfloat16, (0.0, 0.0))


def test_rounding_apart_in_bfloat16_passes_the_float32_check(monkeypatch):
    model, inputs = bf16_llama()
    pruner = randomised(DTPPruner(model, inputs, {"mlp": 0.5}))
    parameters = {name: (p, p.dtype) for name, p in model.named_parameters()}
    strict_bf16(monkeypatch)
    exported = pruner.export()
    with torch.no_grad(), pruner.hard_masked():
        want = model(*inputs).logits
    with torch.no_grad():
        got = exported(*inputs).logits
    assert not proof.close(got, want)  # the first check failed: the float32 one decided
    assert {n: (p, p.dtype) for n, p in model.named_parameters()} == parameters
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("device", DEVICES)
def test_the_float32_check_runs_where_the_model_is(device, monkeypatch):
    """Outputs taken as parted in bfloat16 whatever they are (so the float32 check runs
    on every device): it decides, on the model's device, and the model and its export
    keep their dtypes and device."""
    model, (ids,) = bf16_llama()
    model, inputs = model.to(device), (ids.to(device),)
    pruner = randomised(DTPPruner(model, inputs, {"mlp": 0.5}))
    real, seen = pruner_module._mismatch, []

    def parted_in_bf16(got, want):
        seen.append((want[0].dtype, want[0].device.type))
        return ("parted", "rounding") if want[0].dtype == torch.bfloat16 else real(got, want)

    monkeypatch.setattr(pruner_module, "_mismatch", parted_in_bf16)
    exported = pruner.export()
    assert seen == [(torch.bfloat16, device), (torch.float32, device)]
    for module in (model, exported):
        assert {(p.dtype, p.device.type) for p in module.parameters()} == {(torch.bfloat16, device)}


def test_a_wrong_export_is_refused_in_float32_too(monkeypatch):
    model, inputs = bf16_llama()
    pruner = randomised(DTPPruner(model, inputs, {"mlp": 0.5}))
    plain_export = base.ChannelPruner.export

    def wrong(self):  # one kept neuron's down-projection column off
        pruned = plain_export(self)
        with torch.no_grad():
            pruned.model.layers[0].mlp.down_proj.weight[:, 0] += 1
        return pruned

    monkeypatch.setattr(base.ChannelPruner, "export", wrong)
    with pytest.raises(ExportMismatchError, match="with the weights in float32"):
        pruner.export()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_running_out_of_memory_for_the_float32_check_says_how_to_export(monkeypatch):
    model, inputs = bf16_llama()
    pruner = randomised(DTPPruner(model, inputs, {"mlp": 0.5}))
    strict_bf16(monkeypatch)

    def no_memory(_):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("dtp_kernels.pruning.pruner.float32_weights", no_memory)
    with pytest.raises(ExportMismatchError, match=r"ran out of memory: export with the model"):
        pruner.export()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_float32_weights_give_back_each_tensor_its_own_dtype():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].to(torch.bfloat16)
    model[1].to(torch.float16)  # a buffer of another half dtype, and one of float32 kept
    model[1].register_buffer("scale", torch.ones(4))
    before = {n: (t, t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    values = {n: t.clone() for n, (t, _) in before.items()}
    with pytest.raises(RuntimeError, match="inside"), float32_weights(model):
        assert {t.dtype for t in model.parameters()} == {torch.float32}
        assert model[1].running_mean.dtype == torch.float32
        raise RuntimeError("inside")
    after = dict([*model.named_parameters(), *model.named_buffers()])
    for name, (tensor, dtype) in before.items():
        assert after[name].dtype == dtype, name
        torch.testing.assert_close(after[name], values[name], rtol=0, atol=0)
        if isinstance(tensor, nn.Parameter):
            assert after[name] is tensor, name
