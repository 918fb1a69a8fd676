"""Functions tests/dist/test_complex_params.py runs on every rank."""

from __future__ import annotations

import torch
from torch import nn

import fsg
from tests.dist.workers import preset_rules


class SpectralConv(nn.Module):
    """A Fourier neural operator's layer: complex weights on the lowest ``modes`` frequencies
    of ``x [B, C, T]``, then a real linear head."""

    def __init__(self, channels: int = 4, modes: int = 5, length: int = 8):
        super().__init__()
        self.length, self.modes = length, modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)
        self.head = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x)[..., : self.modes]
        mixed = torch.einsum("bix,iox->box", spectrum, self.weight)
        y = torch.fft.irfft(mixed, n=self.length)
        return self.head(torch.nn.functional.gelu(y).transpose(1, 2)).squeeze(-1)


def complex_params_on_a_mesh(axes: dict, preset: str, optimizer: str) -> bool:
    """A spectral layer with complex weights, sharded under ``preset``: equal to the
    unsharded step after every step (params, optimizer state, loss)."""
    torch.manual_seed(0)
    model = SpectralConv()
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 4, 8, generator=g), "y": torch.randn(8, 8, generator=g)} for _ in range(3)]

    def loss_fn(params, batch):
        return ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()

    opt = {"adamw": fsg.optim.adamw(1e-2, weight_decay=0.1), "sgd": fsg.optim.sgd(0.1, momentum=0.9)}[optimizer]
    fsg.testing.assert_sharded_matches_unsharded(
        loss_fn, fsg.params(model), batches, fsg.testing.mesh(axes), optimizer=opt,
        param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp"),
    )  # fmt: skip
    return True
