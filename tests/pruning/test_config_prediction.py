"""pruner.config_describes_export(): whether export() will leave a config that
describes the exported model (so save_pretrained's files load), said before any export
and agreeing with what the export then writes; the model's config and its parts'
sub-configs are left as they were (benchmarks/hf_prune_check.py checks the prediction
against the export over every architecture it builds). config_forecast's advice, the
ratios that keep save_pretrained, gives a config that describes the export."""

import warnings

import pytest
import torch
from test_vision_language import llava

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.config_forecast import config_forecast
from dtp_kernels.pruning.conv1d import conv1d_to_linear
from dtp_kernels.pruning.hf_config import describes
from utils import LLAMA_VOCAB, TINY_BERT, group_norm_net, tiny_llama

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, LLAMA_VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))


def predicted_then_exported(model, inputs, ratios, **options) -> tuple[bool | None, bool]:
    """The prediction, checked to leave the config as it was, and whether the export's
    config describes it."""
    pruner = DTPPruner(model, inputs, ratios, **options)
    before = model.config.to_json_string()
    predicted = pruner.config_describes_export()
    assert model.config.to_json_string() == before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the export's own warning when it cannot
        exported = pruner.export()
    return predicted, describes(exported)


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=LLAMA_VOCAB, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    conv1d_to_linear(model)  # as `dtp prune` takes it
    return model


@pytest.mark.parametrize(
    "ratios, described",
    [
        (0.5, True),  # one count per kind: heads, key/value heads, intermediate_size
        ({"heads": 0.25, "mlp": 0.75}, True),
        # the two MLPs keep 24 and 12: one intermediate_size cannot hold both
        ({"mlp": 0.5, "model.layers.1.mlp.gate_proj": 0.75}, False),
        ({"model.layers.0.self_attn": 0.5}, False),  # one layer's heads, not the other's
    ],
)
def test_a_llama_is_predicted_as_exported(ratios, described):
    assert predicted_then_exported(tiny_llama(), (IDS,), ratios) == (described, described)


def test_gpt2_heads_cannot_be_described_and_its_mlps_can():
    """GPT-2 derives its head size from n_embd / n_head: no config holds fewer heads. Its
    unset n_inner (4 x n_embd) is written with the MLPs' kept width."""
    for ratios, described in [(0.5, False), ({"heads": 0, "mlp": 0.5}, True)]:
        assert predicted_then_exported(gpt2(), (IDS,), ratios) == (described, described)


def test_a_composite_models_sub_configs_stay_the_parts_own():
    """LLaVA's vision tower and language model hold its vision_config and text_config:
    the prediction writes sizes there and gives them back, the same objects. (CLIP's
    head size is hidden_size / heads, and no field holds the projector's width: they
    stay whole for a config that describes the rest.)"""
    whole = {"model.multi_modal_projector.*": 0, "heads": 0, "mlp": 0.5}
    for ratios, described in [(whole, True), (0.5, False)]:
        model, inputs = llava()
        language, vision = model.model.language_model, model.model.vision_tower
        assert predicted_then_exported(model, inputs, ratios) == (described, described)
        assert language.config is model.config.text_config
        assert vision.config is model.config.vision_config


def test_unstructured_pruning_keeps_the_config_and_a_cnn_has_none():
    predicted, exported = predicted_then_exported(tiny_llama(), (IDS,), 0.5, granularity="weight")
    assert predicted is exported is True
    pruner = DTPPruner(group_norm_net(), (torch.randn(1, 3, 8, 8),), 0.5)
    assert pruner.config_describes_export() is None


def bert_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY_BERT, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def siglip_classifier() -> torch.nn.Module:
    """SigLIP's vision tower with its attention-pooling head (an MLP of its own)."""
    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.SiglipConfig(
        vision_config=tower | {"image_size": 16, "patch_size": 4},
        text_config=tower | {"vocab_size": 64, "eos_token_id": 1},
    )
    return transformers.SiglipForImageClassification(config)


def mobilebert() -> torch.nn.Module:
    """MobileBERT: four MLPs per layer (intermediate_size each) and the bottleneck its
    queries and keys read (true_hidden_size, which sizes the rest of the layer too)."""
    torch.manual_seed(0)
    config = transformers.MobileBertConfig(
        vocab_size=64,
        hidden_size=32,
        embedding_size=16,
        true_hidden_size=16,
        intra_bottleneck_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
    )
    return transformers.MobileBertForMaskedLM(config)


FORECASTS = {
    # GPT-2's heads, whole everywhere: the advice per kind
    "gpt2": (gpt2, (IDS,), 0.5, {"heads": 0, "mlp": 0.5}),
    # BERT's heads (head size hidden_size / heads) everywhere, and its pooler's width,
    # which no field holds: a 0 per kind, and by name beside the kind's other groups
    "bert-classifier": (
        bert_classifier,
        (IDS,),
        0.5,
        {"heads": 0, "mlp": 0.5, "bert.pooler.dense": 0},
    ),
    # SigLIP's heads; its encoder's and its pooling head's MLPs share intermediate_size,
    # so they are described together, not one at a time
    "siglip-classifier": (
        siglip_classifier,
        (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)),),
        0.5,
        {"heads": 0, "mlp": 0.5},
    ),
    # MobileBERT's MLPs, which no one of the four alone describes, less its bottlenecks,
    # which no field describes
    "mobilebert": (
        mobilebert,
        (IDS,),
        0.5,
        {
            "heads": 0,
            "mlp": 0.5,
            "mobilebert.encoder.layer.0.bottleneck.attention.dense": 0,
            "mobilebert.encoder.layer.1.bottleneck.attention.dense": 0,
        },
    ),
    # LLaVA's vision heads and projector only (its language model's heads are described):
    # a 0 for each of those groups' names
    "llava": (
        lambda: llava()[0],
        llava()[1],
        0.5,
        {
            "*": 0.5,
            "model.vision_tower.encoder.layers.0.self_attn": 0,
            "model.vision_tower.encoder.layers.1.self_attn": 0,
            "model.multi_modal_projector.linear_1": 0,
        },
    ),
}


@pytest.mark.parametrize("family", FORECASTS)
def test_the_advised_ratios_keep_a_config_that_describes_the_export(family):
    build, inputs, ratios, advice = FORECASTS[family]
    forecast = config_forecast(DTPPruner(build(), inputs, ratios))
    assert forecast["describes"] is False and forecast["ratios"] == advice
    assert predicted_then_exported(build(), inputs, advice) == (True, True)


def test_no_advice_where_only_leaving_everything_whole_would_do():
    """The two MLPs asked for different counts, and nothing else pruned."""
    ratios = {"mlp": 0.5, "model.layers.1.mlp.gate_proj": 0.75}
    forecast = config_forecast(DTPPruner(tiny_llama(), (IDS,), ratios))
    assert forecast == {"describes": False, "whole": [], "ratios": None}
    described = config_forecast(DTPPruner(tiny_llama(), (IDS,), 0.5))
    assert described == {"describes": True, "whole": [], "ratios": None}
