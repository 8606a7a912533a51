"""Models that exporters cannot handle, for the error-path tests."""
import torch
from torch import nn


class DataDependent(nn.Module):
    """Output shape depends on input values: no exporter can give it a static graph."""

    output_names = ["y"]

    def forward(self, x):
        return torch.nonzero(x > 0).float().sum(0, keepdim=True) + x[:, :2] * 0 if x.sum() > 0 else x


def build_data_dependent():
    return DataDependent().eval()


class PairwiseDistances(nn.Module):
    """Distances between the rows of each sample (torch.cdist): torch 2.13's dynamo exporter cannot
    convert cdist to ONNX, TorchScript's can (measured), so `exporter: auto` must fall back."""

    output_names = ["d"]

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        rows = self.proj(x).view(x.shape[0], 4, 8)
        return torch.cdist(rows, rows).flatten(1)


def build_pairwise_distances():
    torch.manual_seed(0)
    return PairwiseDistances().eval()
