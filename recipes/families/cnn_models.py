"""A small grayscale CNN for recipes/families/cnn-gray.yaml."""
import torch
from torch import nn


def gray_cnn(width: int = 64, classes: int = 10, seed: int = 0):
    """Conv-BN-ReLU x3 over 1-channel images, global pooling, a linear classifier (random seeded weights)."""
    torch.manual_seed(seed)
    layers, channels = [], 1
    for stride in (1, 2, 2):
        layers += [nn.Conv2d(channels, width, 3, stride=stride, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)).eval()
