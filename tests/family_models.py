"""Small models of the families that real users bring, each built to show one failure class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn


class GridHead(nn.Module):
    """A detector head that caches its anchor grid in forward, as YOLO's Detect does: the grid is
    made on the first call and reused. Made under inference_mode, it cannot be saved for backward."""

    def __init__(self, classes: int = 3, stride: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 5 + classes, 1)
        self.stride = stride
        self.grid = torch.empty(0)

    def forward(self, x):
        y = self.conv(x)
        if self.grid.shape[2:4] != y.shape[2:4]:
            h, w = y.shape[2:4]
            yv, xv = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            self.grid = torch.stack((xv, yv), 0).view(1, 2, h, w).float() + 0.5
        xy = y[:, :2].sigmoid() * self.grid * self.stride  # a Mul saves the grid for backward
        return torch.cat([xy, y[:, 2:4].exp(), y[:, 4:].sigmoid()], 1).flatten(2).transpose(1, 2)


@dataclass
class Detections:
    boxes: torch.Tensor
    scores: torch.Tensor
    extras: Optional[torch.Tensor] = None  # None leaves are left out


class Heads(NamedTuple):
    logits: torch.Tensor
    features: torch.Tensor


class StructuredOutputs(nn.Module):
    """forward returns a dataclass; `nested` returns a tuple holding a dict (any structure is named); `named_tuple` a
    NamedTuple."""

    def __init__(self, nested: bool = False, named_tuple: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.nested, self.named_tuple = nested, named_tuple
        self.linear = nn.Linear(8, 6)

    def forward(self, x):
        y = self.linear(x)
        if self.nested:
            return y, {"aux": y.relu(), "count": 3}
        if self.named_tuple:
            return Heads(logits=y[:, :4], features=y)
        return Detections(boxes=y[:, :4], scores=y[:, 4:].softmax(-1))


def grid_head():
    return GridHead().eval()


def structured(nested: bool = False, named_tuple: bool = False):
    return StructuredOutputs(nested, named_tuple).eval()


class GrayCNN(nn.Module):
    """Conv-BN-ReLU on single-channel images."""

    output_names = ["logits"]

    def __init__(self, channels: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def gray_cnn(channels: int = 1):
    return GrayCNN(channels).eval()


class StridedConcat(nn.Module):
    """Downsample by 2, upsample back, concatenate: sizes must be even, as a detector's must be multiples of its stride."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.down = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")

    def forward(self, x):
        return torch.cat([x, self.up(self.down(x))], 1)


def strided_concat():
    return StridedConcat().eval()


def wide_cnn():
    """Conv-BN-ReLU blocks 64 channels wide: room for structured pruning at any SIMD width."""
    torch.manual_seed(0)
    layers, channels = [], 3
    for _ in range(3):
        layers += [nn.Conv2d(channels, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU()]
        channels = 64
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).eval()


class TokensAndMask(nn.Module):
    """forward(ids, mask): two integer inputs of one shape, which a recipe can list in either order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8)

    def forward(self, ids, mask):
        return self.emb(ids) * mask.unsqueeze(-1).float()


def tokens_and_mask(scripted: bool = False):
    net = TokensAndMask().eval()
    return torch.jit.script(net) if scripted else net
