"""Small models and data shared by the tests."""

from __future__ import annotations

import torch
from torch import nn

import fsg


def mlp(d_in: int = 8, d_hidden: int = 32, d_out: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_out))


def regression_batch(n: int = 16, d_in: int = 8, d_out: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, d_in, generator=g), "y": torch.randn(n, d_out, generator=g)}


def mse_loss_fn(model: nn.Module):
    def loss_fn(params, batch):
        out = fsg.apply(model, params, batch["x"])
        return ((out - batch["y"]) ** 2).mean()

    return loss_fn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
