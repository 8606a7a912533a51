"""Small PyTorch models for the tiny recipe and the tests: fast to export and to measure."""
from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    """A two-layer MLP classifier over [batch, features]."""

    output_names = ["logits"]

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class TinyCNN(nn.Module):
    """Conv-BN-ReLU blocks and a classifier over [batch, 3, H, W] images."""

    output_names = ["logits"]

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        layers, channels = [], 3
        for out in (width, width * 2, width * 2):
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


def build_mlp(seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return TinyMLP(**kwargs).eval()


def build_cnn(seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    model = TinyCNN(**kwargs)
    # Non-trivial BatchNorm statistics, so that folding them is actually tested.
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()
