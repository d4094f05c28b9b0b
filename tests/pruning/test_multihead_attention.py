"""multihead_attention.py: what a pruned nn.MultiheadAttention exports to. With every head
kept it computes what torch's does (masks of every kind, batched or not); handed a mask
per head made for all the layer's heads (Mask2Former's decoder makes one), the exported
layer picks its kept heads' masks, equal to the hard-masked model with kept heads that
are not the first ones; a file saved before the layers held `kept_heads` still loads.
torch's own nn.TransformerEncoder, nn.TransformerDecoder and nn.Transformer prune and
export exactly, the encoder's ragged fast path (eval with a padding mask) included."""

import json

import pytest
import torch
from torch import nn

from dtp_kernels import load_pruned, save_pruned
from dtp_kernels.pruning import DTPPruner, built_model
from dtp_kernels.pruning.cost import count_flops, count_params
from dtp_kernels.pruning.multihead_attention import PrunedMultiheadAttention
from utils import exported_as_masked


@pytest.mark.parametrize("batch_first", [False, True])
def test_keeping_every_head_is_nn_multihead_attention(batch_first):
    """Outputs and weights, with an attention mask (one for all heads, or one per head),
    a key padding mask, a causal mask, batched or not."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    pruned = PrunedMultiheadAttention(mha, torch.arange(48)).eval()
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    attn_mask = torch.rand(5, 7) > 0.7
    attn_mask[:, 0] = False  # every query sees a key
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, -2:] = True
    for kwargs in (
        {},
        {"attn_mask": attn_mask},
        {"attn_mask": torch.randn(2 * 4, 5, 7), "average_attn_weights": False},
        {"key_padding_mask": padding, "average_attn_weights": False},
    ):
        want = mha(q, kv, kv, **kwargs)
        got = pruned(q, kv, kv, **kwargs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    causal = torch.ones(5, 7, dtype=torch.bool).triu(1)  # is_causal without a mask
    for a, b in zip(
        pruned(q, kv, kv, is_causal=True), mha(q, kv, kv, attn_mask=causal), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # torch's rule: with no padding mask and no weights asked for, is_causal stands for
    # the mask it is given, whatever that mask holds
    hinted = {"attn_mask": attn_mask, "is_causal": True, "need_weights": False}
    torch.testing.assert_close(
        pruned(q, kv, kv, **hinted)[0], mha(q, kv, kv, **hinted)[0], rtol=1e-5, atol=1e-6
    )
    single = q[0] if batch_first else q[:, 0]
    single_kv = kv[0] if batch_first else kv[:, 0]
    for a, b in zip(
        pruned(single, single_kv, single_kv), mha(single, single_kv, single_kv), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class PerHeadMasked(nn.Module):
    """Attention handed a mask per head that the model makes for all the layer's heads
    (a learned bias per head here; Mask2Former's decoder makes a boolean one), then a
    linear readout."""

    def __init__(self, heads: int = 4, width: int = 16, tokens: int = 6) -> None:
        super().__init__()
        self.heads = heads
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens) * 3)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.readout = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.bias.repeat(len(x), 1, 1)  # (batch * heads, tokens, tokens)
        out, _ = self.attention(x, x, x, attn_mask=mask, need_weights=False)
        return self.readout(out)


def pruned_per_head_masked() -> tuple[nn.Module, DTPPruner, torch.Tensor]:
    torch.manual_seed(0)
    model, x = PerHeadMasked().eval(), torch.randn(2, 6, 16)
    pruner = DTPPruner(model, (x,), {"heads": 0.5})
    with torch.no_grad():
        pruner.scores.copy_(torch.tensor([0.9, 0.1, 0.2, 0.8]))  # heads 0 and 3 kept
    return model, pruner, x


def test_a_mask_per_head_gives_the_kept_heads_theirs():
    model, pruner, x = pruned_per_head_masked()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    assert isinstance(exported.attention, PrunedMultiheadAttention)
    assert exported.attention.kept_heads.tolist() == [0, 3]
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)


def test_a_file_saved_without_kept_heads_loads(tmp_path):
    """Files written before PrunedMultiheadAttention held `kept_heads` lack it: their
    layers (never handed a mask per head) load with their first heads."""
    torch.manual_seed(0)
    builder = "torchvision.models.vision_transformer:VisionTransformer"
    kwargs = dict(image_size=16, patch_size=4, num_layers=1, num_heads=4, hidden_dim=32, mlp_dim=64)
    model, x = built_model.build(builder, kwargs).eval(), torch.randn(2, 3, 16, 16)
    pruner = DTPPruner(model, (x[:1],), {"heads": 0.5})
    with torch.no_grad():
        pruner.scores.copy_(torch.tensor([0.1, 0.9, 0.2, 0.8]))
    exported = pruner.export().eval()
    path = tmp_path / "model.safetensors"
    save_pruned(path, exported, builder=builder, builder_kwargs=kwargs)
    from safetensors.torch import load_file, save_file

    fields, _ = built_model.read_header(path)
    tensors = load_file(str(path))
    key = "encoder.layers.encoder_layer_0.self_attention.kept_heads"
    assert tensors.pop(key).tolist() == [1, 3]
    save_file(tensors, str(path), metadata=fields)
    loaded = load_pruned(path).eval()
    attention = loaded.encoder.layers.encoder_layer_0.self_attention
    assert attention.kept_heads.tolist() == [0, 1]
    assert json.loads(fields["replaced"])  # loaded as the class export made
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), exported(x), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_kept_heads_live_on_the_models_device(device):
    model, pruner, x = pruned_per_head_masked()
    model.to(device)
    pruner.to(device)
    x = x.to(device)
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    assert exported.attention.kept_heads.device.type == device
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-4, atol=1e-4)


class Seq2Seq(nn.Module):
    """torch's nn.Transformer between two linear embeddings and a readout, the target
    masked causally; batch first or sequence first."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.source, self.target = nn.Linear(8, 16), nn.Linear(8, 16)
        self.transformer = nn.Transformer(16, 4, 2, 2, 32, dropout=0.0, batch_first=batch_first)
        self.readout, self.batch_first = nn.Linear(16, 4), batch_first

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(y.shape[1])
        if not self.batch_first:
            x, y = x.transpose(0, 1), y.transpose(0, 1)
        out = self.transformer(self.source(x), self.target(y), tgt_mask=causal, tgt_is_causal=True)
        return self.readout(out if self.batch_first else out.transpose(0, 1))


@pytest.mark.parametrize("batch_first", [False, True])
def test_torchs_transformer_prunes_its_heads_and_mlps_and_exports_exactly(batch_first):
    torch.manual_seed(0)
    model = Seq2Seq(batch_first)
    x, y = torch.randn(3, 6, 8), torch.randn(3, 5, 8)
    pruner = DTPPruner(model, (x[:1], y[:1]), 0.5)
    with torch.no_grad():  # kept heads and neurons other than the first ones
        pruner.scores.copy_(
            torch.rand(pruner.scores.shape, generator=torch.Generator().manual_seed(3))
        )
    kinds = {"self_attn": 4, "multihead_attn": 2, "linear1": 4}
    for kind, count in kinds.items():
        assert sum(g.name.endswith(kind) for g in pruner.groups) == count
    exported = exported_as_masked(pruner, model, (x, y))
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
    assert count_flops(exported, (x[:1], y[:1])) == report["flops_after"]
    attention = exported.transformer.decoder.layers[0].self_attn
    assert isinstance(attention, PrunedMultiheadAttention) and attention.num_heads == 2


class PaddedEncoder(nn.Module):
    """torch's nn.TransformerEncoder (post-norm, batch first: its ragged fast path in eval
    with a padding mask) between a linear embedding and a readout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.readout = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return self.readout(self.encoder(self.embed(x), src_key_padding_mask=padding))


def test_torchs_transformer_encoder_exports_exactly_on_its_ragged_fast_path(monkeypatch):
    """In eval with a padding mask the encoder hands its layers nested (ragged) batches:
    the exported attention computes them padded, and equals the hard-masked model."""
    torch.manual_seed(0)
    model, x = PaddedEncoder(), torch.randn(3, 6, 8)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:], padding[2, 2:] = True, True
    pruner = DTPPruner(model, (x[:1],), {"heads": 0.5})
    with torch.no_grad():
        pruner.scores.copy_(torch.tensor([0.9, 0.1, 0.2, 0.8] * 2))
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x, padding)
    exported = pruner.export().eval()
    ragged = []
    compute = PrunedMultiheadAttention._ragged
    monkeypatch.setattr(
        PrunedMultiheadAttention,
        "_ragged",
        lambda self, *args: ragged.append(1) or compute(self, *args),
    )
    with torch.no_grad():
        got = exported(x, padding)
    assert len(ragged) == 2  # both layers were handed ragged batches
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
