"""Leaves of every rank, 0-d ones included, train exactly as in eager PyTorch (issue 60).

A donated 0-d float64 parameter never moved under ``backend="aot_eager"`` while it went
through ``torch.compile``: Dynamo's ``_tensorify_python_scalars`` pass took the input for a
Python float it had wrapped and dropped the graph's ``copy_`` into it. The property: params of
ranks drawn from 0 to 4, a 0-d buffer the forward updates, a 0-d batch leaf, trained through
``compile_step`` (donated or not, accumulated or not) equal ``torch.optim`` on the module in
float64. The mesh half is ``tests/dist/test_zero_dim_mesh.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsg

STEPS = 3


class Scalars(nn.Module):
    """Parameters of the given ranks (each dim of size 2), a 0-d buffer updated by the forward."""

    def __init__(self, ranks: tuple[int, ...], seed: int = 0, update_buffer: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ws = nn.ParameterList(
            [nn.Parameter(torch.randn((2,) * r, generator=g, dtype=torch.float64) * 0.5) for r in ranks]
        )
        self.register_buffer("running", torch.tensor(1.0, dtype=torch.float64))
        self.update_buffer = update_buffer

    def forward(self, x_B2: torch.Tensor) -> torch.Tensor:
        h_B = x_B2.sum(-1)
        if self.update_buffer:
            self.running.mul_(0.9).add_(0.1 * h_B.detach().abs().mean())
        for w in self.ws:
            h_B = h_B * torch.sigmoid(w).mean() + torch.tanh(w).sum()
        return h_B / (1.0 + self.running)


def batch(seed: int, scale: bool = True) -> dict[str, torch.Tensor]:
    """``x``, ``y`` and, unless accumulated (a 0-d leaf has no dim 0 to split), a 0-d ``scale``."""
    g = torch.Generator().manual_seed(100 + seed)
    b = {
        "x": torch.randn(4, 2, generator=g, dtype=torch.float64),
        "y": torch.randn(4, generator=g, dtype=torch.float64),
    }
    return {**b, "scale": torch.tensor(0.5 + seed, dtype=torch.float64)} if scale else b


def loss_of(out: torch.Tensor, b: dict) -> torch.Tensor:
    return ((out - b["y"]) ** 2).mean() * b.get("scale", 1.0)


OPTIMIZERS = {
    "sgd": (lambda: fsg.optim.sgd(0.3, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9)),
    "adamw": (
        lambda: fsg.optim.adamw(0.1, weight_decay=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.01),
    ),
}


def eager(ranks, optimizer: str, update_buffer: bool, scale: bool = True) -> tuple[dict, dict]:
    model = Scalars(ranks, update_buffer=update_buffer)
    opt = OPTIMIZERS[optimizer][1](model.parameters())
    for i in range(STEPS):
        opt.zero_grad()
        b = batch(i, scale)
        loss_of(model(b["x"]), b).backward()
        opt.step()
    return fsg.params(model), fsg.buffers(model)


def trained(ranks, optimizer: str, update_buffer: bool, mesh=None, scale: bool = True, **kwargs) -> tuple[dict, dict]:
    model = Scalars(ranks, update_buffer=update_buffer)

    def loss_fn(params, b, buffers):
        return loss_of(fsg.apply(model, params, b["x"], buffers=buffers), b)

    step = fsg.compile_step(loss_fn, mesh, optimizer=OPTIMIZERS[optimizer][0](), **kwargs)
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    for i in range(STEPS):
        state, _ = step(state, batch(i, scale))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.params.items()}
    return full, {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.buffers.items()}


def assert_equal(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    for name in want[0]:
        assert got[0][name].shape == want[0][name].shape, name
        torch.testing.assert_close(got[0][name], want[0][name], rtol=1e-10, atol=1e-12, msg=name)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-10, atol=1e-12, msg=name)


ranks_strategy = st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple)


@settings(max_examples=12)
@given(
    ranks=ranks_strategy,
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    donate=st.booleans(),
    accum_steps=st.sampled_from([1, 2]),
)
@example(ranks=(0,), optimizer="sgd", donate=True, accum_steps=1)  # the reported case
@example(ranks=(0, 4), optimizer="adamw", donate=True, accum_steps=2)
def test_leaves_of_every_rank_train_as_eager(ranks, optimizer, donate, accum_steps):
    # the buffer's update runs once a microbatch, and the 0-d batch leaf cannot be split: both
    # only where the step is not accumulated (accumulated, the 0-d leaf is a BatchError)
    whole = accum_steps == 1
    got = trained(ranks, optimizer, whole, scale=whole, backend="aot_eager", donate=donate, accum_steps=accum_steps)
    assert_equal(got, eager(ranks, optimizer, whole, scale=whole))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_lone_0d_parameter_moves_under_donation(backend):
    """The issue's repro: SGD on one 0-d float64 parameter, donated."""
    w = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
    model = nn.Module()
    model.w = w

    def loss_fn(params, b):
        return torch.sigmoid(b["x"] * params["w"]).sum()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.5), backend=backend)
    state = step.init({"w": w.detach()})
    x = torch.arange(4.0, dtype=torch.float64)
    opt = torch.optim.SGD([w], lr=0.5)
    for _ in range(2):
        state, _ = step(state, {"x": x})
        opt.zero_grad()
        torch.sigmoid(x * w).sum().backward()
        opt.step()
    assert state.params["w"].item() != 0.7
    torch.testing.assert_close(state.params["w"], w.detach(), rtol=1e-12, atol=0)


@pytest.mark.inductor
def test_leaves_of_every_rank_train_as_eager_under_inductor():
    ranks = (0, 1, 0, 3)
    got = trained(ranks, "adamw", True, backend="inductor")
    assert_equal(got, eager(ranks, "adamw", True))
