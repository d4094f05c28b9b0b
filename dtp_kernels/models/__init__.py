"""The paper's CIFAR networks, and torchvision's ImageNet ones by name (pipeline layer).

`get_model(name, num_classes)` builds any of them with random weights (no download).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .cifar_resnet import resnet20, resnet56
from .digits_cnn import digits_cnn
from .mobilenet_v2 import mobilenet_v2
from .vgg import vgg19_bn
from .wide_resnet import wrn26

CIFAR_MODELS: dict[str, Callable[..., nn.Module]] = {
    "digits_cnn": digits_cnn,
    "resnet20": resnet20,
    "resnet56": resnet56,
    "vgg19_bn": vgg19_bn,
    "mobilenet_v2": mobilenet_v2,
    "wrn26": wrn26,
}
TORCHVISION_MODELS = ("resnet34", "resnet50", "mobilenet_v2")


def get_model(name: str, num_classes: int = 10, **kwargs) -> nn.Module:
    """A model by name: the CIFAR ones above, or "torchvision.<name>" for ResNet-34/50 and
    MobileNetV2 from torchvision (ImageNet layouts); `kwargs` go to its builder."""
    if name.startswith("torchvision."):
        import torchvision

        short = name.removeprefix("torchvision.")
        if short not in TORCHVISION_MODELS:
            raise ValueError(f"model {name!r}: torchvision models here: {list(TORCHVISION_MODELS)}")
        return getattr(torchvision.models, short)(weights=None, num_classes=num_classes, **kwargs)
    if name not in CIFAR_MODELS:
        known = list(CIFAR_MODELS) + [f"torchvision.{n}" for n in TORCHVISION_MODELS]
        raise ValueError(f"unknown model {name!r}; known: {known}")
    return CIFAR_MODELS[name](num_classes=num_classes, **kwargs)


__all__ = ["digits_cnn", "get_model", "mobilenet_v2", "resnet20", "resnet56", "vgg19_bn", "wrn26"]
