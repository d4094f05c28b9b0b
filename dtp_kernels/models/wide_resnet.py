"""Wide ResNet for CIFAR (Zagoruyko & Komodakis 2016): pre-activation basic blocks,
(depth - 2) / 6 blocks per stage, widths 16k / 32k / 64k. WRN-26 uses depth 26."""

from __future__ import annotations

import torch
from torch import nn


class WideBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))
        return out + skip


class WideResNet(nn.Module):
    def __init__(self, depth: int = 26, width: int = 4, num_classes: int = 100) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"WideResNet depth must be 6n + 2, got {depth}")
        n = (depth - 2) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        stages, cin = [], widths[0]
        for cout, stride in zip(widths[1:], (1, 2, 2), strict=True):
            blocks = [
                WideBlock(cin if i == 0 else cout, cout, stride if i == 0 else 1) for i in range(n)
            ]
            stages.append(nn.Sequential(*blocks))
            cin = cout
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        x = nn.functional.adaptive_avg_pool2d(torch.relu(self.bn(x)), 1)
        return self.fc(torch.flatten(x, 1))


def wrn26(num_classes: int = 100, width: int = 4) -> WideResNet:
    return WideResNet(26, width, num_classes)
