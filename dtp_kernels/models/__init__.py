"""The paper's CIFAR networks, and torchvision's by name (pipeline layer)."""

from .cifar_resnet import resnet20, resnet56
from .vgg import vgg19_bn

__all__ = ["resnet20", "resnet56", "vgg19_bn"]
