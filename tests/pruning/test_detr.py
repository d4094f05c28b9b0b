"""Hugging Face's DETR, Table Transformer and DAB-DETR (with a timm ResNet backbone and
its frozen batch norms, as pretrained weights build it) and RT-DETR (its own ResNet, a hybrid
encoder and a deformable decoder), built small: a float ratio prunes the backbone's
filters, the encoder's and decoder's attention heads (cross-attention too) and their MLP
neurons; the exported model predicts the hard-masked model's class logits and boxes with
the parameters the report gives."""

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.config_forecast import config_forecast
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.heads import HeadGroup
from dtp_kernels.pruning.pruned_classes import pruned_classes

transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")

SMALL = dict(num_queries=5, num_labels=3, encoder_layers=1, decoder_layers=1)
HEADS = dict(encoder_attention_heads=4, decoder_attention_heads=4)


def detr(family: str = "Detr"):
    """A small DETR, or a detector of DETR's config (Table Transformer's: its attention
    code older, a reshape to the width)."""
    config = getattr(transformers, f"{family}Config")(
        use_timm_backbone=True,
        use_pretrained_backbone=False,
        backbone="resnet18",
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        **SMALL,
        **HEADS,
    )
    return getattr(transformers, f"{family}ForObjectDetection")(config)


def dab_detr():
    """A small DAB-DETR: its encoder's attention is DETR's older code (a reshape to the
    width: exported as PrunedDabDetrEncoderAttention); its decoder's attention projects
    outside the attention layer (not a head form: left whole). Its encoder scales the
    position embeddings by an MLP, drawn here so that they count (init makes them ~1e-3)."""
    config = transformers.DabDetrConfig(
        use_timm_backbone=True,
        use_pretrained_backbone=False,
        backbone="resnet18",
        hidden_size=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        **SMALL,
        **HEADS,
    )
    model = transformers.DabDetrForObjectDetection(config)
    with torch.no_grad():
        for layer in model.model.encoder.query_scale.layers:
            layer.weight.normal_(0, 1, generator=torch.Generator().manual_seed(2))
    return model


def rt_detr():
    backbone = transformers.RTDetrResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16, 16, 16],
        depths=[1, 1, 1, 1],
        out_features=["stage2", "stage3", "stage4"],
    )
    config = transformers.RTDetrConfig(
        backbone_config=backbone,
        encoder_hidden_dim=16,
        encoder_in_channels=[16, 16, 16],
        decoder_in_channels=[16, 16, 16],
        d_model=32,
        encoder_ffn_dim=32,
        decoder_ffn_dim=64,
        num_denoising=0,
        **SMALL,
        **HEADS,
    )
    return transformers.RTDetrForObjectDetection(config)


class Predictions(torch.nn.Module):
    """The detector's class logits and boxes from its images."""

    def __init__(self, detector: torch.nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.detector(pixel_values=images)
        return out.logits, out.pred_boxes


@pytest.mark.parametrize(
    ("build", "heads", "ratios"),
    [
        # the encoder's self-attention, the decoder's self- and cross-attention
        (
            detr,
            ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "encoder_attn"],
            0.5,
        ),
        # the same; its attention layers are exported as PrunedTableTransformerAttention
        (
            lambda: detr("TableTransformer"),
            ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "encoder_attn"],
            0.5,
        ),
        # the encoder's self-attention; the box head's first layer, whose weights the
        # decoder holds too (one mask: test_the_box_head_the_decoder_holds_too_...)
        (dab_detr, ["encoder.layers.0.self_attn"], 0.5),
        # the hybrid encoder's self-attention, the decoder's self-attention (its
        # deformable cross-attention samples per head: left whole); the projection that
        # scores the encoder's tokens for the queries feeds a LayerNorm: left whole, as
        # the float's refusal says
        (
            rt_detr,
            ["encoder.aifi.0.layers.0.self_attn", "decoder.layers.0.self_attn"],
            {"*": 0.5, "detector.model.enc_output.0": 0},
        ),
    ],
)
def test_a_detr_prunes_with_a_float_and_exports_equal(build, heads, ratios):
    torch.manual_seed(0)
    model = Predictions(build()).eval()
    images = torch.randn(2, 3, 64, 64)
    pruner = DTPPruner(model, (images[:1],), ratios)
    head_groups = [g.name for g in pruner.groups if isinstance(g, HeadGroup)]
    assert len(head_groups) == len(heads)
    for name, suffix in zip(head_groups, heads, strict=True):
        assert name.endswith(suffix)
    convs = [g for g in pruner.groups if isinstance(g.layer, torch.nn.Conv2d)]
    assert convs, "the backbone's filters are pruned"
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    exported = pruner.export().eval()
    for name in head_groups:  # the class export gives a layer of its code, where it has one
        dense = type(model.get_submodule(name))
        assert type(exported.get_submodule(name)) is pruned_classes().get(dense, dense)
    with torch.no_grad(), pruner.hard_masked():
        want = model(images)
    with torch.no_grad():
        got = exported(images)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
    assert report["speedup"] > 1.3


def test_the_box_head_the_decoder_holds_too_prunes_with_one_mask_and_is_forecast_so():
    """DAB-DETR's decoder holds the box predictor's MLP as a module of its own with the
    same weights: their groups are one tie set (the predictor's reads the decoder's
    mask), exported equal to the hard-masked model with the parameters reported; the
    config forecast leaves the set whole together, and its ratios build a pruner whose
    config describes the export."""
    torch.manual_seed(0)
    model, images = dab_detr().eval(), torch.randn(2, 3, 64, 64)
    pruner = DTPPruner(model, (images[:1],), 0.5)
    names = [g.name for g in pruner.groups]
    first, later = "model.decoder.bbox_embed.layers.0", "bbox_predictor.layers.0"
    assert pruner.mask_of[names.index(later)] == names.index(first)
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
        with pruner.hard_masked():
            want = model(images)
        exported = pruner.export().eval()
        got = exported(images)
    torch.testing.assert_close(got.pred_boxes, want.pred_boxes, rtol=1e-5, atol=1e-5)
    box, decoder_box = exported.bbox_predictor.layers[0], exported.model.decoder.bbox_embed
    assert box.weight is decoder_box.layers[0].weight
    assert count_params(exported) == pruner.report()["params_after"]
    ratios = config_forecast(pruner)["ratios"]
    assert ratios[first] == ratios[later] == 0
    pruner.remove()
    assert DTPPruner(model, (images[:1],), ratios).config_describes_export()
