"""ResNet-50 (v1.5, the torchvision layout) as a recipe factory: `factory: optpipe.models.resnet:resnet50`.

Why it lives here: torchvision from PyPI does not import beside the CPU-only torch
2.13 wheel this project installs by default (DESIGN.md), so a recipe using
`torchvision: resnet50` needs the `vision` extra. This module defines the same
architecture (same layers, shapes and initialisation scheme as
`torchvision.models.resnet50(weights=None)`) in plain torch, so the ResNet-50
recipe runs on the default install. The weights are random (seeded): fine for
speed, and the accuracy columns then measure agreement with the FP32 model, not
ImageNet accuracy.
"""
from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride, as in v1.5) -> 1x1 expand, plus the shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    output_names = ["logits"]

    def __init__(self, blocks: tuple[int, ...], num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages, channels = [], 64
        for index, count in enumerate(blocks):
            width = 64 * 2**index
            layers = []
            for block in range(count):
                layers.append(Bottleneck(channels, width, stride=2 if index > 0 and block == 0 else 1))
                channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        self._init_like_torchvision()

    def _init_like_torchvision(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet50(num_classes: int = 1000, seed: int = 0) -> ResNet:
    """ResNet-50 with seeded random weights (no pretrained weights can be fetched here)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = ResNet((3, 4, 6, 3), num_classes)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()
