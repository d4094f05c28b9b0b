"""alibi_attention.py and picked_heads.py: attention layers handed ALiBi biases for all the
model's heads (BLOOM's, MPT's, Falcon's when built with ALiBi) lose heads and add their
kept heads' own entries of the bias. With every head kept the class export gives
computes exactly what transformers' does; pruned, the export equals the hard-masked
model (padded batches, generation through the cache, a builder's file, a second
pruning), with kept heads that are not the first ones, so adding the first entries
would fail; Falcon built without ALiBi keeps its own class."""

import pytest
import torch

from dtp_kernels import load_pruned, save_pruned
from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.heads import HeadGroup
from dtp_kernels.pruning.precision import ieee_fp32

transformers = pytest.importorskip("transformers")
from dtp_kernels.pruning.alibi_attention import PRUNED_CLASSES  # noqa: E402
from dtp_kernels.pruning.picked_heads import PicksItsHeads  # noqa: E402

VOCAB = 64
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# family: (builder's family, config sizes, attention implementation)
MODELS = {
    "bloom": ("Bloom", dict(hidden_size=32, n_layer=2, n_head=4), "eager"),
    "mpt": ("Mpt", dict(d_model=32, n_layers=2, n_heads=4), "eager"),
    "falcon": (
        "Falcon",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True),
        "sdpa",
    ),
    "falcon, eager": (
        "Falcon",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True),
        "eager",
    ),
    "falcon, multi-query": (
        "Falcon",
        dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, multi_query=True
        ),
        "eager",
    ),
}


def sizes(family: str) -> dict:
    return {"vocab_size": VOCAB, **TOKEN_IDS, **MODELS[family][1]}


def build(family: str) -> torch.nn.Module:
    name, _, implementation = MODELS[family]
    config = getattr(transformers, f"{name}Config")(**sizes(family))
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 9 tokens, the second left-padded by 3 (ALiBi's positions count
    from the first token the mask keeps)."""
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids, mask = inputs()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    return out[mask.bool()]  # the padded positions attend to nothing


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m) in PRUNED_CLASSES or isinstance(m, PicksItsHeads)]


@pytest.mark.parametrize("family", MODELS)
def test_every_head_kept_computes_what_transformers_computes(family):
    model = build(family)
    want = logits(model)
    layers = attention_layers(model)
    assert len(layers) == 2
    for layer in layers:
        PRUNED_CLASSES[type(layer)].from_dense(layer)
        assert layer.kept_heads.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(logits(model), want, rtol=0, atol=0)


def pruned(family: str) -> tuple[torch.nn.Module, DTPPruner]:
    """The model with half its heads and MLP channels pruned, scored at random, heads
    kept that are not the first ones."""
    model = build(family)
    ids, mask = inputs()
    pruner = DTPPruner(
        model, {"input_ids": ids, "attention_mask": mask}, {"heads": 0.5, "mlp": 0.5}
    )
    heads = [g for g in pruner.groups if isinstance(g, HeadGroup)]
    assert [g.size for g in heads] == [4, 4]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    return model, pruner


def kept_heads(pruner: DTPPruner) -> list[list[int]]:
    masks = pruner.hard_masks()
    return [
        mask.nonzero().flatten().tolist()
        for group, mask in zip(pruner.groups, masks, strict=True)
        if isinstance(group, HeadGroup)
    ]


def exported_checked(model: torch.nn.Module, pruner: DTPPruner) -> torch.nn.Module:
    with pruner.hard_masked():
        want = logits(model)
    kept = kept_heads(pruner)
    assert any(k != list(range(len(k))) for k in kept)  # not the first heads
    exported = pruner.export().eval()
    torch.testing.assert_close(logits(exported), want, rtol=1e-5, atol=1e-5)
    layers = attention_layers(exported)
    assert [layer.kept_heads.tolist() for layer in layers] == kept
    assert all(isinstance(layer, PicksItsHeads) for layer in layers)
    return exported


@pytest.mark.parametrize("family", MODELS)
def test_heads_export_equal_to_the_hard_masked_model(family):
    """The exported layers add their kept heads' entries of the bias the model still
    computes for all its heads; the config keeps the model's head count (a model built
    with fewer heads would compute other slopes), so it cannot describe the export."""
    model, pruner = pruned(family)
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = exported_checked(model, pruner)
    assert all(
        getattr(layer, PRUNED_CLASSES[layer.replaces].head_count) == 2
        for layer in attention_layers(exported)
    )
    assert exported.config.num_attention_heads == 4
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon, eager"])
def test_the_export_generates_what_the_hard_masked_model_generates(family):
    """Greedy decoding through the key/value cache: the bias of each new token is picked
    as the prompt's was."""
    model, pruner = pruned(family)
    ids, mask = inputs()
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad(), pruner.hard_masked():
        want = model.generate(ids, attention_mask=mask, **options)
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    with torch.no_grad():
        got = exported.generate(ids, attention_mask=mask, **options)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_a_builder_file_loads_the_kept_heads(family, tmp_path):
    _, pruner = pruned(family)
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    path = tmp_path / "model.safetensors"
    kwargs = {"family": MODELS[family][0], "sizes": sizes(family)}
    save_pruned(path, exported, builder="utils:causal_lm", builder_kwargs=kwargs)
    loaded = load_pruned(path).eval()
    layers = attention_layers(loaded)
    assert all(isinstance(layer, PicksItsHeads) for layer in layers)
    assert [layer.kept_heads.tolist() for layer in layers] == kept_heads(pruner)
    torch.testing.assert_close(logits(loaded), logits(exported), rtol=0, atol=0)


def test_a_second_pruning_keeps_heads_of_the_models_heads():
    """Pruning an exported model again keeps the model's heads it kept, fewer of them."""
    _, pruner = pruned("bloom")
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    first = kept_heads(pruner)
    ids, mask = inputs()
    again = DTPPruner(exported, {"input_ids": ids, "attention_mask": mask}, {"heads": 0.5})
    with torch.no_grad():
        again.scores.copy_(torch.tensor([0.1, 0.9] * (again.scores.numel() // 2)))
    with again.hard_masked():
        want = logits(exported)
    with pytest.warns(UserWarning, match="config cannot describe"):
        twice = again.export().eval()
    torch.testing.assert_close(logits(twice), want, rtol=1e-5, atol=1e-5)
    assert [layer.kept_heads.tolist() for layer in attention_layers(twice)] == [
        [heads[1]] for heads in first
    ]


def test_falcon_without_alibi_keeps_its_class():
    """Rotary Falcon is handed no bias: its layers keep transformers' class and state
    dict."""
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **TOKEN_IDS
    )
    config.new_decoder_architecture, config.num_kv_heads = True, 4
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    ids, mask = inputs()
    pruner = DTPPruner(model, {"input_ids": ids, "attention_mask": mask}, {"heads": 0.5})
    with pytest.warns(UserWarning, match="config cannot describe"):  # head_dim is derived
        exported = pruner.export().eval()
    attention = transformers.models.falcon.modeling_falcon.FalconAttention
    layers = [m for m in exported.modules() if isinstance(m, attention)]
    assert [type(layer) for layer in layers] == [attention] * 2
    assert [layer.num_heads for layer in layers] == [2, 2]
    assert not any("kept_heads" in key for key in exported.state_dict())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_kept_heads_live_on_the_models_device(family, device):
    """The kept heads' indices are a buffer of the model's device, and the export on it
    equals the hard-masked model there."""
    model, pruner = pruned(family)
    model.to(device)
    pruner.to(device)
    ids, mask = (t.to(device) for t in inputs())
    with torch.no_grad(), pruner.hard_masked(), ieee_fp32():
        want = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    with pytest.warns(UserWarning, match="config cannot describe"):
        exported = pruner.export().eval()
    assert {layer.kept_heads.device.type for layer in attention_layers(exported)} == {device}
    with torch.no_grad(), ieee_fp32():
        got = exported(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
