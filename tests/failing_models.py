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


class RelativeHeads(nn.Module):
    """T5-style attention (a relative-position bias, SDPA, transpose + contiguous + reshape): with dynamic
    batch and sequence, torch 2.13's dynamo exporter fails ("Cannot view a tensor with shape [s0, s1, 4, 8]
    ... as (s0, s1, 32)", measured) while the TorchScript trace matches eager at every shape; the shape
    test below makes the tracer warn about a Python boolean, as transformers' models do."""

    output_names = ["y"]

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.rel = nn.Embedding(16, 4)

    def forward(self, x):
        if x.shape[-1] != 32:
            raise ValueError("expected 32 features")
        b, n = x.shape[0], x.shape[1]
        h = self.q(x).view(b, -1, 4, 8).transpose(1, 2)
        pos = torch.arange(n)
        bias = self.rel((pos[None, :] - pos[:, None]).clamp(-8, 7) + 8).permute(2, 0, 1).unsqueeze(0)
        a = torch.nn.functional.scaled_dot_product_attention(h, h, h, attn_mask=bias, scale=1.0)
        return a.transpose(1, 2).contiguous().reshape(b, n, -1) + x


def build_relative_heads():
    torch.manual_seed(0)
    return RelativeHeads().eval()


class LengthBranch(nn.Module):
    """Doubles its output past 8 tokens: a branch on a shape that a trace at 8 tokens fixes to one
    side, right at the trace size and wrong at longer sequences."""

    output_names = ["y"]

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        y = self.proj(x)
        return y * 2 if x.shape[1] > 8 else y


def build_length_branch():
    torch.manual_seed(0)
    return LengthBranch().eval()
