"""Keyed random ops on CUDA (skipped without a GPU): the same values as on CPU, dropout traced
through native_dropout (what CUDA tensors take), Triton's int64 hash equal to eager's, CUDA
graph replay advancing the key, attention dropout through the math attention."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsg
from fsg._src.trace import random as keyed
from tests.helpers import regression_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _draw(fn, device):
    with keyed.Keyed(torch.tensor([5, 9], device=device)):
        return fn(device)


def test_cuda_draws_what_cpu_draws():
    def ops(device):
        ones = torch.ones(4096, device=device)
        return torch.rand(4096, device=device), torch.randn(4096, device=device), torch.native_dropout(ones, 0.3, True)

    (u_cpu, n_cpu, (d_cpu, m_cpu)), (u, n, (d, m)) = _draw(ops, "cpu"), _draw(ops, "cuda")
    assert torch.equal(u.cpu(), u_cpu)  # integer hashing and exact conversions: bit for bit
    assert torch.equal(m.cpu(), m_cpu) and torch.equal(d.cpu(), d_cpu)
    torch.testing.assert_close(n.cpu(), n_cpu)  # log and cos may round differently


def _model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4)).cuda()


def _losses(steps=3, **options):
    model = _model()

    def loss_fn(params, batch):
        return ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(1e-2), **options)
    state = step.init(fsg.params(model), seed=3)
    batch = {k: v.cuda() for k, v in regression_batch(n=16).items()}
    text = step.lower(state, batch).as_text("traced")
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert state.rng.tolist() == [3, steps]
    return losses, text


def test_dropout_on_cuda_is_keyed_and_inductor_with_graph_replay_matches_eager():
    eager, text = _losses(backend="eager", cuda_graph=False)
    assert "native_dropout.default" not in text and "bitwise_xor" in text  # its backward stays
    assert eager == _losses(backend="eager", cuda_graph=False)[0]
    assert len(set(eager)) == len(eager)
    compiled, _ = _losses()  # Inductor (Triton), replayed as a CUDA graph
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_attention_dropout_on_cuda_runs_the_math_attention_keyed():
    def loss_fn(params, batch):
        q = (batch @ params["w"]).unflatten(-1, (2, 16)).transpose(1, 2)  # [B, heads, T, 16]
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.2, is_causal=True).square().mean()

    def run():
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager")
        state = step.init({"w": torch.randn(32, 32, generator=torch.Generator().manual_seed(0)).cuda()})
        batch = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)).cuda()
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return losses

    first = run()
    assert first == run()
