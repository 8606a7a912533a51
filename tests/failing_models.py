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
