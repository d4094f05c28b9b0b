"""The classes export gives attention layers whose code ties the head size or the output
width to the model width (torchvision's Swin, Video Swin and MaxViT, timm's EVA, BEiT,
Swin V2 and others, Hugging Face's TrOCR, PVT v2, TimeSformer, Table Transformer,
Mask2Former and OneFormer): subclasses with the same parameters whose forward takes the
sizes from the pruned projections, looked up by the layer's class; and those handed
ALiBi for all the model's heads (BLOOM's, MPT's, Falcon's) or a relative position bias
for them (WavLM's), whose forward picks the kept heads' entries (picked_heads.py)."""

from __future__ import annotations

import importlib
import sys

from torch import nn

# the libraries' modules holding attention layers whose code ties the head size or the
# output width to the model width, and this package's modules of the classes export
# gives them
PRUNED_CLASS_MODULES = {
    "torchvision.models.swin_transformer": "torchvision_attention",
    "torchvision.models.maxvit": "torchvision_attention",
    "torchvision.models.video.swin_transformer": "torchvision_attention",
    "timm": "timm_attention",  # EVA's, BEiT's, Swin V2's, DaViT's, XCiT's, EdgeNeXt's, ...
    "transformers.models.trocr.modeling_trocr": "transformers_attention",
    "transformers.models.pvt_v2.modeling_pvt_v2": "transformers_attention",
    "transformers.models.table_transformer.modeling_table_transformer": "transformers_attention",
    "transformers.models.dab_detr.modeling_dab_detr": "transformers_attention",
    "transformers.models.mask2former.modeling_mask2former": "transformers_attention",
    "transformers.models.oneformer.modeling_oneformer": "transformers_attention",
    "transformers.models.timesformer.modeling_timesformer": "transformers_attention",
    "transformers.models.wav2vec2_conformer.modeling_wav2vec2_conformer": (
        "transformers_attention"
    ),
    # handed ALiBi for all the model's heads: they pick their own (picked_heads.py)
    "transformers.models.bloom.modeling_bloom": "alibi_attention",
    "transformers.models.mpt.modeling_mpt": "alibi_attention",
    "transformers.models.falcon.modeling_falcon": "alibi_attention",
    # handed a relative position bias for all the model's heads by the first layer
    "transformers.models.wavlm.modeling_wavlm": "wavlm_attention",
}


class GivenToTheLayer:
    """A class export gives the layer itself: its parameters, buffers and state-dict keys
    stay (a loader gives it the saved shapes)."""

    @classmethod
    def from_dense(cls, layer: nn.Module) -> nn.Module:
        """`layer` itself, given this class."""
        layer.__class__ = cls  # type: ignore[assignment]  # (its subclasses are modules)
        return layer


def pruned_classes() -> dict[type[nn.Module], type[GivenToTheLayer]]:
    """The class export gives an attention layer of each class above that loses heads
    (`from_dense(layer)` gives it). Only the libraries' modules already imported are
    looked at: a model holding such a layer has imported its module. A library version
    without the classes these subclass gives none: its layers fail their heads' proof and
    are refused by name, as without this package's classes."""
    classes: dict[type[nn.Module], type[GivenToTheLayer]] = {}
    for library, own in PRUNED_CLASS_MODULES.items():
        if library in sys.modules:
            try:
                classes |= importlib.import_module(f"{__package__}.{own}").PRUNED_CLASSES
            except (ImportError, AttributeError):
                continue
    return classes
