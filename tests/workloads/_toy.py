"""The small regression problem the plain-loop test workloads train: fixed data and an MLP, seeded the same way
in every replica (so replicas that trained the same samples hold the same weights)."""

from __future__ import annotations

import torch
from torch import nn


def toy_problem(samples: int, batchnorm: bool = False) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """`batchnorm`: a BatchNorm1d after the first layer, whose statistics every forward moves."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    norm = [nn.BatchNorm1d(32)] if batchnorm else []
    return x, y, nn.Sequential(nn.Linear(16, 32), *norm, nn.Tanh(), nn.Linear(32, 1))
