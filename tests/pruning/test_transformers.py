"""DTP on Hugging Face Llama models (tiny configurations built here, nothing downloaded):
attention heads with grouped-query attention, gated MLPs, the export invariant, exact
counts, gradients, training steps, the exported config, save/load and generate()."""

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.heads import HeadGroup
from utils import LLAMA_VOCAB as VOCAB
from utils import TINY_BERT, TINY_HF_VIT, tiny_llama

transformers = pytest.importorskip("transformers")


def tokens(batch=2, length=9, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_groups_are_heads_and_gated_mlps():
    model = tiny_llama()
    pruner = DTPPruner(model, (tokens(),), {"heads": 0.5, "mlp": 0.25})
    kinds = [(g.name, type(g).__name__, g.size) for g in pruner.groups]
    assert kinds == [
        ("model.layers.0.self_attn", "HeadGroup", 2),  # units: key/value heads
        ("model.layers.0.mlp.gate_proj", "ChannelGroup", 48),
        ("model.layers.1.self_attn", "HeadGroup", 2),
        ("model.layers.1.mlp.gate_proj", "ChannelGroup", 48),
    ]
    assert pruner.kept == [1, 36, 1, 36]
    mlp = pruner.groups[1]
    assert mlp.gated and {m for m in mlp.kept_out} == {
        model.model.layers[0].mlp.gate_proj,
        model.model.layers[0].mlp.up_proj,
    }


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 2)])
def test_export_equals_hard_masked_with_exact_counts(heads, kv_heads):
    model = tiny_llama(heads, kv_heads)
    ids = tokens()
    pruner = DTPPruner(model, (ids,), {"heads": 0.5, "mlp": 0.5})
    with torch.no_grad():  # scores away from their initial order
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = pruner.export()  # checks the invariant itself; asserted here too
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(ids).logits
    got = exported.eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kept_units = kv_heads // 2
    per_unit = heads // kv_heads
    for layer in exported.model.layers:
        attn = layer.self_attn
        assert attn.q_proj.out_features == kept_units * per_unit * 8
        assert attn.k_proj.out_features == attn.v_proj.out_features == kept_units * 8
        assert attn.o_proj.in_features == kept_units * per_unit * 8
        assert layer.mlp.gate_proj.out_features == layer.mlp.up_proj.out_features == 24
        assert layer.mlp.down_proj.in_features == 24
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_exported_config_round_trips_and_generates(tmp_path):
    model = tiny_llama()
    ids = tokens()
    exported = DTPPruner(model, (ids,), {"heads": 0.5, "mlp": 0.5}).export()
    config = exported.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert (config.head_dim, config.intermediate_size) == (8, 24)
    exported.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, exported.eval()(ids).logits)
    generated = loaded.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4)


def test_a_config_its_own_checks_refuse_is_left_with_a_warning():
    """Llama's config wants hidden_size divisible by the heads: 3 of 4 kept is refused."""
    model = tiny_llama(heads=4, kv_heads=4)
    pruner = DTPPruner(model, (tokens(),), {"heads": 0.25})
    with pytest.warns(UserWarning, match=r"config cannot describe its sizes"):
        exported = pruner.export()
    assert exported.config.num_attention_heads == 4  # unchanged, never half-written
    assert exported.model.layers[0].self_attn.q_proj.out_features == 24


def test_uneven_layers_warn_that_the_config_cannot_hold_them():
    model = tiny_llama()
    ratios = {"model.layers.0.self_attn": 0.5, "mlp": 0.5}  # layer 1 keeps its heads
    pruner = DTPPruner(model, (tokens(),), ratios)
    with pytest.warns(UserWarning, match=r"config cannot describe its sizes"):
        pruner.export()


def test_every_score_gets_the_gradient_of_the_other_backend():
    """Head and gated-MLP scores receive gradients; the compiled and the eager backends
    agree on them."""
    grads = {}
    for backend in ("torch", "cpu"):
        model = tiny_llama()
        pruner = DTPPruner(model, (tokens(),), {"heads": 0.5, "mlp": 0.5}, backend=backend)
        model.train()
        loss = torch.nn.functional.cross_entropy(
            model(tokens(seed=3)).logits.flatten(0, 1), tokens(seed=4).flatten()
        )
        loss.backward()
        grads[backend] = pruner.scores.grad.clone()
    for part in grads["cpu"].split([2, 48, 2, 48]):
        assert part.abs().max() > 0
    torch.testing.assert_close(grads["cpu"], grads["torch"], rtol=1e-4, atol=1e-7)


def test_training_steps_move_the_scores_and_lower_the_loss():
    model = tiny_llama()
    ids = tokens(batch=4, length=12, seed=5)
    pruner = DTPPruner(model, (ids,), {"heads": 0.5, "mlp": 0.5})
    optimizer = torch.optim.Adam([*model.parameters(), pruner.scores], lr=1e-2)
    pruner.attach(optimizer)
    start = pruner.scores.detach().clone()
    losses = []
    model.train()
    for _ in range(8):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(start, pruner.scores.detach())
    assert int(pruner.state.steps) == 8
    exported = pruner.export()
    assert exported.config.num_attention_heads == 2


def test_heads_ratio_kind_prunes_heads_only():
    pruner = DTPPruner(tiny_llama(), (tokens(),), {"heads": 0.5})
    assert all(isinstance(g, HeadGroup) for g in pruner.groups)
    assert len(pruner.groups) == 2


class OddAttention(torch.nn.Module):
    """Has the q/k/v/o form, but its 12 channels are not whole heads of head_dim 5."""

    def __init__(self):
        super().__init__()
        self.head_dim = 5
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 12) for _ in range(3))
        self.o_proj = torch.nn.Linear(12, 8)

    def forward(self, x):
        return self.o_proj(self.q_proj(x) * self.k_proj(x) + self.v_proj(x))


def test_heads_that_do_not_split_are_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), OddAttention())
    with pytest.raises(ValueError, match=r"layer '1': q_proj.*head_dim 5"):
        DTPPruner(model, (torch.randn(2, 8),), {"heads": 0.5})


def test_hugging_face_vit_heads_and_mlp_round_trip(tmp_path):
    config = transformers.ViTConfig(num_labels=5, **TINY_HF_VIT)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config)
    x = torch.randn(2, 3, 16, 16)
    pruner = DTPPruner(model, (x[:1],), {"heads": 0.5, "mlp": 0.5})
    assert [g.size for g in pruner.groups] == [4, 64, 4, 64] and pruner.kept == [2, 32, 2, 32]
    exported = pruner.export().eval()
    assert (exported.config.num_attention_heads, exported.config.intermediate_size) == (2, 32)
    exported.save_pretrained(tmp_path)
    loaded = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, exported(x).logits)


def test_a_proof_runs_over_the_block_holding_the_output_projection():
    """BERT's output projection lies beside its self-attention, in the block holding
    both: the proof runs there. A BERT whose output shifts the heads' features by one
    before that projection is refused by name when the pruner is made."""
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    output = model.bert.encoder.layer[0].attention.output

    def shifted(hidden_states, input_tensor):
        hidden = output.dense(hidden_states.roll(1, dims=-1))
        return output.LayerNorm(output.dropout(hidden) + input_tensor)

    output.forward = shifted
    with pytest.raises(ValueError, match=r"'bert.encoder.layer.0.attention.self': with some"):
        DTPPruner(model, (tokens(),), {"heads": 0.5})


def test_bert_heads_export_and_a_config_that_cannot_say_so_is_kept():
    """BERT derives its head size from hidden_size / heads, so no config describes fewer
    heads of the same size: the model is exported right and the config left unchanged,
    with a warning (a model rebuilt from a changed config would differ)."""
    config = transformers.BertConfig(**TINY_BERT)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    ids = tokens()
    pruner = DTPPruner(model, (ids,), {"heads": 0.5, "*.intermediate.dense": 0.5})
    assert [type(g).__name__ for g in pruner.groups] == ["HeadGroup", "ChannelGroup"] * 2
    with pytest.warns(UserWarning, match=r"config cannot describe its sizes"):
        exported = pruner.export()
    attention = exported.bert.encoder.layer[0].attention
    assert (attention.self.num_attention_heads, attention.self.all_head_size) == (2, 16)
    assert attention.output.dense.in_features == 16
    assert (exported.config.num_attention_heads, exported.config.intermediate_size) == (4, 64)
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(ids).logits
    torch.testing.assert_close(exported.eval()(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_magnitude_baseline_keeps_the_heads_of_largest_l1():
    from dtp_kernels import L1Pruner

    model = tiny_llama(heads=4, kv_heads=4)
    pruner = L1Pruner(model, (tokens(),), {"heads": 0.5})
    for group, mask in zip(pruner.groups, pruner.hard_masks(), strict=True):
        columns = group.layer.weight.detach().abs()  # o_proj: (hidden, heads * 8)
        l1 = torch.stack([columns[:, 8 * h : 8 * (h + 1)].sum() for h in range(4)])
        assert mask.tolist() == [float(h in l1.topk(2).indices) for h in range(4)]
    exported = pruner.export()
    assert exported.config.num_attention_heads == 2


def phi3():
    config = transformers.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config)


def test_phi3_fused_heads_and_gate_up_pairs_prune_and_the_config_round_trips(tmp_path):
    """Phi-3 fuses query, key and value into qkv_proj (all query heads, then the key and
    value heads) and gate and up into gate_up_proj, chunked in two: a head group's unit
    is a key/value head with its query heads, an MLP group's unit gate channel i with up
    channel i + intermediate_size. The export keeps exactly those rows, computes what
    the hard-masked model does, and its config (which the attention reads its head count
    from) rebuilds it with from_pretrained, which generates."""
    model, ids = phi3(), tokens()
    pruner = DTPPruner(model, (ids,), {"heads": 0.5, "mlp": 0.5})
    assert [(type(g).__name__, g.size) for g in pruner.groups] == [
        ("HeadGroup", 2),
        ("ChannelGroup", 48),
    ] * 2
    assert [g.parts for g in pruner.groups[1::2]] == [2, 2]
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    masks = pruner.hard_masks()
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(ids).logits
    exported = pruner.export().eval()
    layers = zip(model.model.layers, exported.model.layers, masks[::2], strict=True)
    for dense, layer, heads in layers:
        unit = int(heads.nonzero())  # the kept key/value head, with its 2 query heads of 8
        rows = [*range(16 * unit, 16 * unit + 16), *range(32 + 8 * unit, 40 + 8 * unit)]
        rows += range(48 + 8 * unit, 56 + 8 * unit)  # query, key, value rows
        torch.testing.assert_close(
            layer.self_attn.qkv_proj.weight, dense.self_attn.qkv_proj.weight[rows]
        )
        assert layer.self_attn.o_proj.in_features == 16
        assert (layer.mlp.gate_up_proj.out_features, layer.mlp.down_proj.in_features) == (48, 24)
    config = exported.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.intermediate_size == 24
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, want, rtol=1e-5, atol=1e-5)
    exported.save_pretrained(tmp_path)
    loaded = transformers.Phi3ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, exported(ids).logits)
    assert loaded.generate(ids[:1], max_new_tokens=3, do_sample=False).shape == (1, 12)


def test_phi3_heads_kept_unevenly_across_layers_are_refused_at_export():
    """Phi-3's attention reads its query head count from the config all layers share:
    pruning one layer's heads alone cannot export, and says why."""
    from dtp_kernels.pruning import ExportMismatchError

    pruner = DTPPruner(phi3(), (tokens(),), {"model.layers.0.self_attn": 0.5})
    with pytest.raises(ExportMismatchError, match=r"must keep the same number of heads"):
        pruner.export()


def test_phi3_heads_whose_config_cannot_be_written_are_refused_at_export(monkeypatch):
    """The safety net behind the even-count rule: were the config left unchanged (any
    reason its rebuild check fails), the exported attention would read the old head
    count, so export raises instead of returning it."""
    from dtp_kernels.pruning import ExportMismatchError, base

    monkeypatch.setattr(base, "update_config", lambda model, groups, masks: False)
    pruner = DTPPruner(phi3(), (tokens(),), {"heads": 0.5})
    with pytest.raises(ExportMismatchError, match=r"cannot describe the exported heads"):
        pruner.export()
