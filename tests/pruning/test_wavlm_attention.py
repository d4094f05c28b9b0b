"""wavlm_attention.py: WavLM's attention layers lose heads, each layer its own. With
every head kept the class export gives computes what transformers' does; pruned, the
export equals the hard-masked model (padded batches, both encoder variants, heads kept
that are not the first ones, 8 heads as many as the gate's outputs, a builder's file, a
second pruning), the first layer still handing on the bias of all the model's heads."""

import pytest
import torch

from dtp_kernels import load_pruned, save_pruned
from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops, count_params
from dtp_kernels.pruning.heads import HeadGroup
from dtp_kernels.pruning.precision import ieee_fp32
from utils import randomised, tiny_speech_encoder

transformers = pytest.importorskip("transformers")
from dtp_kernels.pruning.wavlm_attention import PrunedWavLMAttention  # noqa: E402

BUCKETS = {"num_buckets": 16, "max_bucket_distance": 40}
VARIANTS = {"post-norm": {}, "stable layer norm": {"do_stable_layer_norm": True}}


def build(**options) -> torch.nn.Module:
    """The tiny WavLM, its bias table and gates drawn large enough (its init draws them
    near 0) that a head given another head's bias or gate changes the output."""
    model = tiny_speech_encoder("WavLM", **BUCKETS, **options).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in attention_layers(model):
            for tensor in (layer.gru_rel_pos_linear.weight, layer.gru_rel_pos_const):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            if hasattr(layer, "rel_attn_embed"):
                weight = layer.rel_attn_embed.weight
                weight.copy_(3 * torch.randn(weight.shape, generator=generator))
    return model


def audio() -> tuple[torch.Tensor, torch.Tensor]:
    """Two clips of 400 samples, the second padded after 280 (its mask ends there)."""
    x = torch.randn(2, 400, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 400, dtype=torch.long)
    mask[1, 280:] = 0
    x[1, 280:] = 0
    return x, mask


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m.attention for m in model.wavlm.encoder.layers]


def pruned(**options) -> tuple[torch.nn.Module, DTPPruner]:
    """The model with half its heads and MLP neurons pruned, scored at random."""
    model = build(**options)
    x, mask = audio()
    pruner = DTPPruner(
        model, {"input_values": x, "attention_mask": mask}, {"heads": 0.5, "mlp": 0.5}
    )
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [g.name for g in heads] == [f"wavlm.encoder.layers.{i}.attention" for i in (0, 1)]
    return model, randomised(pruner)


def outputs(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    x, mask = audio()
    with torch.no_grad():
        out = model(input_values=x, attention_mask=mask, output_attentions=True)
    return (out.logits, *out.attentions)


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_head_kept_computes_what_transformers_computes(options):
    model = build(**options)
    want = outputs(model)
    for layer in attention_layers(model):
        PrunedWavLMAttention.from_dense(layer)
        assert layer.kept_heads.tolist() == [0, 1, 2, 3]
    for got, expected in zip(outputs(model), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_heads_export_equal_to_the_hard_masked_model(options):
    model, pruner = pruned(**options)
    with torch.no_grad(), pruner.hard_masked():
        want = outputs(model)
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    layers = attention_layers(exported)
    assert all(type(layer) is PrunedWavLMAttention for layer in layers)
    kept = [layer.kept_heads.tolist() for layer in layers]
    assert all(len(heads) == 2 for heads in kept) and [0, 1] not in kept  # not the first
    assert layers[0].rel_attn_embed.weight.shape == (16, 4)  # the bias of all 4 heads
    got = outputs(exported)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for layer, weights in zip(layers, got[1:], strict=True):
        assert weights.shape[1] == layer.num_heads == 2


def test_the_export_has_the_reports_sizes():
    """Parameters and FLOPs as the report predicts: the table of all heads counted kept."""
    _, pruner = pruned()
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    report = pruner.report()
    assert count_params(exported) == report["params_after"] < report["params_before"]
    assert count_flops(exported, pruner.example_inputs) == report["flops_after"]


def test_eight_heads_as_many_as_the_gates_outputs_keep_the_gate_whole():
    """The gate's linear layer has 8 outputs for any head count: with 8 heads it is still
    no table of them."""
    model = build(num_attention_heads=8)
    x, mask = audio()
    pruner = randomised(
        DTPPruner(model, {"input_values": x, "attention_mask": mask}, {"heads": 0.5})
    )
    with torch.no_grad(), pruner.hard_masked():
        want = outputs(model)[0]
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    for layer in attention_layers(exported):
        assert layer.gru_rel_pos_linear.weight.shape == (8, 4) and layer.num_heads == 4
    torch.testing.assert_close(outputs(exported)[0], want, rtol=1e-5, atol=1e-5)


def test_a_builder_file_and_a_second_pruning_keep_the_models_heads(tmp_path):
    _, pruner = pruned()
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    first = [layer.kept_heads.tolist() for layer in attention_layers(exported)]
    path = tmp_path / "model.safetensors"
    kwargs = {"family": "WavLM", **BUCKETS}
    save_pruned(path, exported, builder="utils:tiny_speech_encoder", builder_kwargs=kwargs)
    loaded = load_pruned(path).eval()
    assert [layer.kept_heads.tolist() for layer in attention_layers(loaded)] == first
    torch.testing.assert_close(outputs(loaded)[0], outputs(exported)[0], rtol=0, atol=0)
    x, mask = audio()
    again = DTPPruner(loaded, {"input_values": x, "attention_mask": mask}, {"heads": 0.5})
    with torch.no_grad():
        again.scores.copy_(torch.tensor([0.1, 0.9] * (again.scores.numel() // 2)))
        with again.hard_masked():
            want = outputs(loaded)[0]
    with pytest.warns(UserWarning, match="config cannot describe"):
        twice = again.export().eval()
    torch.testing.assert_close(outputs(twice)[0], want, rtol=1e-5, atol=1e-5)
    assert [layer.kept_heads.tolist() for layer in attention_layers(twice)] == [
        [heads[1]] for heads in first
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_kept_heads_live_on_the_models_device(device):
    """Built on the CPU, moved with its pruner: the kept heads are a buffer of the
    model's device and the export there equals the hard-masked model."""
    model, pruner = pruned()
    model.to(device)
    pruner.to(device)
    x, mask = (t.to(device) for t in audio())
    with torch.no_grad(), pruner.hard_masked(), ieee_fp32():
        want = model(input_values=x, attention_mask=mask).logits
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    assert {layer.kept_heads.device.type for layer in attention_layers(exported)} == {device}
    with torch.no_grad(), ieee_fp32():
        got = exported(input_values=x, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
