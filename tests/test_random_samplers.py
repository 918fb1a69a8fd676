"""The keyed samplers beyond uniforms and normals: ``torch.randperm`` (mixup's shuffle),
``F.rrelu`` in training, ``Tensor.geometric_`` and the Gamma family (``_standard_gamma``,
``_sample_dirichlet``: what ``Gamma``, ``Beta``, ``Dirichlet``, ``Chi2`` and ``StudentT``
sample). Each draws its distribution (Kolmogorov-Smirnov against the exact CDF, or exact
frequencies), from ``state.rng``: the same key the same, eager and Inductor alike."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import distributions as D

import fsg
from fsg._src.trace import random as keyed

KS_LIMIT = 2.5  # sqrt(n) * D beyond 2.5 has probability < 1e-5 under the true distribution


def draw(fn, seed=0, counter=0):
    with keyed.Keyed(torch.tensor([seed, counter])):
        return fn()


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    """sqrt(n) times the largest gap between the empirical CDF of ``samples`` and ``cdf``."""
    x, _ = torch.sort(samples.double().flatten())
    n = x.numel()
    f = cdf(x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return math.sqrt(n) * max((i / n - f).abs().max().item(), (f - (i - 1) / n).abs().max().item())


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 300), st.sampled_from([torch.int64, torch.int32, torch.float32]), st.integers(0, 2**31 - 1))
def test_randperm_is_a_permutation_of_the_asked_dtype(n, dtype, seed):
    p = draw(lambda: torch.randperm(n, dtype=dtype), seed)
    assert p.dtype == dtype and p.shape == (n,)
    assert torch.equal(torch.sort(p.long()).values, torch.arange(n))


def test_randperm_draws_every_permutation_equally_often():
    perms = draw(lambda: [tuple(torch.randperm(4).tolist()) for _ in range(12000)])
    counts = torch.tensor([perms.count(p) for p in set(perms)], dtype=torch.float64)
    assert len(counts) == 24  # all 4! orders occur
    expected = 12000 / 24
    assert torch.all((counts - expected).abs() <= 5 * math.sqrt(expected * (1 - 1 / 24)))


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([0.05, 0.3, 0.9, 1.0, 2.7, 50.0]), st.sampled_from([torch.float32, torch.float64]),
       st.integers(0, 2**31 - 1))  # fmt: skip
def test_standard_gamma_follows_the_gamma_cdf(alpha, dtype, seed):
    a = torch.full((20000,), alpha, dtype=dtype)
    g = draw(lambda: torch._standard_gamma(a), seed)
    assert g.dtype == dtype and torch.all(g > 0) and torch.all(torch.isfinite(g))
    assert ks_statistic(g, lambda x: torch.special.gammainc(torch.tensor(alpha, dtype=torch.float64), x)) < KS_LIMIT


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([0.2, 0.5, 1.0, 2.0]), st.sampled_from([0.4, 1.0, 3.0]), st.integers(0, 2**31 - 1))
def test_beta_samples_have_the_beta_mean_and_variance(a, b, seed):
    x = draw(lambda: D.Beta(torch.tensor(a), torch.tensor(b)).sample((40000,)).double(), seed)
    assert torch.all((x >= 0) & (x <= 1))
    mean, var = a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
    assert abs(x.mean().item() - mean) < 5 * math.sqrt(var / x.numel())
    assert abs(x.var().item() / var - 1) < 0.05


def test_dirichlet_samples_sum_to_one_with_the_dirichlet_means():
    alpha = torch.tensor([0.5, 1.0, 2.0, 4.5])
    x = draw(lambda: D.Dirichlet(alpha).sample((30000,)).double())
    torch.testing.assert_close(x.sum(-1), torch.ones(30000, dtype=torch.float64))
    p = alpha.double() / alpha.sum()
    sigma = (p * (1 - p) / (alpha.sum() + 1) / x.shape[0]).sqrt()
    assert torch.all((x.mean(0) - p).abs() < 5 * sigma)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([0.01, 0.2, 0.5, 0.9, 1.0]), st.integers(0, 2**31 - 1))
def test_geometric_counts_trials_to_the_first_success(p, seed):
    k = draw(lambda: torch.empty(50000, dtype=torch.float64).geometric_(p), seed)
    assert torch.all(k >= 1) and torch.equal(k, k.round())
    for j in (1, 2, 5):  # P(k = j) = (1 - p) ** (j - 1) * p
        q = (1 - p) ** (j - 1) * p
        assert abs((k == j).double().mean().item() - q) <= 5 * math.sqrt(q * (1 - q) / k.numel()) + 1e-12


def test_rrelu_in_training_draws_slopes_in_its_range_and_backpropagates_them():
    x = torch.randn(50000, dtype=torch.float64, requires_grad=True)
    y = draw(lambda: F.rrelu(x, 0.1, 0.3, training=True))
    y.sum().backward()
    neg = x.detach() < 0
    slope = x.grad[neg]
    assert torch.all((slope >= 0.1) & (slope <= 0.3)) and torch.all(x.grad[~neg] == 1)
    torch.testing.assert_close(y.detach()[neg], x.detach()[neg] * slope)
    assert ks_statistic(slope, lambda s: (s - 0.1) / 0.2) < KS_LIMIT


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_mixup_rrelu_and_beta_in_a_step_are_keyed(backend):
    """A loss with the samplers users write (mixup: a Beta-drawn weight and a randperm shuffle
    of the batch; an RReLU model): the same state draws the same, the next step draws anew,
    eager and Inductor alike, and the Gamma-reparametrized sample's gradient flows."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.RReLU(), torch.nn.Linear(8, 3))

    def loss_fn(params, batch):
        x, y = batch
        lam = D.Beta(torch.tensor(0.4), torch.tensor(0.4)).sample()
        perm = torch.randperm(x.shape[0])
        mixed = lam * x + (1 - lam) * x[perm]
        logits = fsg.apply(model, params["net"], mixed)
        loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])
        scale = D.Gamma(params["conc"], torch.tensor(1.0)).rsample()  # gradient into conc
        return loss + 1e-3 * scale, {"perm": perm, "lam": lam}

    params = {"net": fsg.params(model), "conc": torch.tensor(2.0)}
    batch = (torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 3)
    draws = {}
    for b in ("eager", backend):
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend=b, donate=False)
        state = step.init(params, seed=3)
        _, first = step(state, batch)
        _, again = step(state, batch)
        assert torch.equal(first["perm"], again["perm"]) and torch.equal(first["lam"], again["lam"])
        new_state, _ = step(state, batch)
        _, later = step(new_state, batch)
        assert not torch.equal(first["perm"], later["perm"])
        assert not torch.equal(new_state.params["conc"], state.params["conc"])  # rsample's gradient
        draws[b] = first
    assert torch.equal(draws["eager"]["perm"], draws[backend]["perm"])
    torch.testing.assert_close(draws["eager"]["lam"], draws[backend]["lam"])
