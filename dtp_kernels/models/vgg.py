"""VGG-19 with BN for CIFAR (16 conv layers, indices 0-15, and one linear classifier)."""

from __future__ import annotations

import torch
from torch import nn

CONFIG_19 = [
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    512,
]


class CifarVGG(nn.Module):
    def __init__(self, config: list, num_classes: int = 100) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for item in config:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [
                    nn.Conv2d(in_channels, item, 3, padding=1, bias=False),
                    nn.BatchNorm2d(item),
                    nn.ReLU(inplace=True),
                ]
                in_channels = item
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def vgg19_bn(num_classes: int = 100) -> CifarVGG:
    return CifarVGG(CONFIG_19, num_classes)
