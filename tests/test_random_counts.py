"""The keyed count samplers: ``torch.poisson`` (``Poisson.sample``) and ``torch.binomial``
(``Binomial.sample``). Each draws its distribution (every count's frequency within five
standard errors of the exact probability, over hypothesis-drawn parameters on both sides of
the inversion / rejection switch), gives NaN for an invalid parameter, and is keyed by
``state.rng``: the same state the same draws, eager and Inductor alike."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import distributions as D

import fsg
from fsg._src.trace import random as keyed
from fsg._src.trace import random_counts

N = 30000
KS_LIMIT = 2.5  # sqrt(n) * D beyond 2.5 has probability < 1e-5 (less for a discrete law)


def draw(fn, seed=0, counter=0):
    with keyed.Keyed(torch.tensor([seed, counter])):
        return fn()


def assert_frequencies(x: torch.Tensor, log_pmf) -> None:
    """Every count ``k`` occurs within 5 standard errors of ``N * P(k)``, the empirical CDF
    stays within Kolmogorov-Smirnov's bound of the exact one, and no count outside the support
    (``log_pmf`` -inf) occurs."""
    assert torch.equal(x, x.round()), "not whole counts"
    values, counts = torch.unique(x.double(), return_counts=True)
    assert torch.all(torch.isfinite(log_pmf(values))), f"drew counts outside the support: {values}"
    k = torch.arange(0, int(values.max()) + 6, dtype=torch.float64)
    p = torch.exp(log_pmf(k))
    seen = torch.zeros_like(p)
    seen[(values - k[0]).long()] = counts.double()
    expected = x.numel() * p
    sigma = torch.sqrt((expected * (1 - p)).clamp(min=0)).clamp(min=1.0)
    worst = ((seen - expected).abs() / sigma).max().item()
    assert worst < 5, f"count {int(k[((seen - expected).abs() / sigma).argmax()])} off by {worst:.1f} sigma"
    ks = math.sqrt(x.numel()) * (torch.cumsum(seen, 0) / x.numel() - torch.cumsum(p, 0)).abs().max().item()
    assert ks < KS_LIMIT, f"the empirical CDF strays {ks:.2f} / sqrt(n) from the exact one"


def poisson_log_pmf(lam: float):
    return lambda k: -lam + torch.xlogy(k, torch.tensor(lam, dtype=torch.float64)) - torch.lgamma(k + 1)


def binomial_log_pmf(n: float, p: float):
    def log_pmf(k):
        inside = (k >= 0) & (k <= n)
        kk = torch.where(inside, k, torch.zeros_like(k))
        pt = torch.tensor(p, dtype=torch.float64)
        log = math.lgamma(n + 1) - torch.lgamma(kk + 1) - torch.lgamma(n - kk + 1)
        log = log + torch.xlogy(kk, pt) + torch.xlogy(n - kk, 1 - pt)
        return torch.where(inside, log, torch.full_like(log, -math.inf))

    return log_pmf


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([0.0, 0.04, 0.7, 4.0, 9.99, 10.0, 17.5, 300.0, 5e4]),
       st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31 - 1))  # fmt: skip
def test_poisson_draws_the_poisson_probabilities(lam, dtype, seed):
    x = draw(lambda: torch.poisson(torch.full((N,), lam, dtype=dtype)), seed)
    assert x.dtype == dtype and x.shape == (N,)
    assert_frequencies(x, poisson_log_pmf(lam))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(0, 0.5), (1, 0.5), (7, 0.3), (40, 0.1), (40, 0.93), (25, 0.5), (30, 1.0),
                        (30, 0.0), (200, 0.3), (5000, 0.77), (1e5, 0.01)]),
       st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31 - 1))  # fmt: skip
def test_binomial_draws_the_binomial_probabilities(n_p, dtype, seed):
    n, p = n_p
    x = draw(lambda: torch.binomial(torch.full((N,), float(n), dtype=dtype), torch.full((N,), p, dtype=dtype)), seed)
    assert x.dtype == dtype and x.shape == (N,)
    assert_frequencies(x, binomial_log_pmf(float(n), p))


def test_each_element_draws_from_its_own_parameters_across_both_regimes():
    rates = torch.tensor([0.5, 9.0, 11.0, 2000.0]).repeat(N // 4)
    x = draw(lambda: D.Poisson(rates).sample()).view(-1, 4)
    for j, lam in enumerate([0.5, 9.0, 11.0, 2000.0]):
        assert_frequencies(x[:, j], poisson_log_pmf(lam))
    n = torch.tensor([[3.0], [60.0], [400.0]])
    p = torch.tensor([0.2, 0.7])  # broadcast: [3, 2]
    y = draw(lambda: D.Binomial(n.expand(3, 2).repeat(N // 6, 1, 1), probs=p.expand(3, 2).repeat(N // 6, 1, 1)).sample())
    for i, count in enumerate([3.0, 60.0, 400.0]):
        for j, prob in enumerate([0.2, 0.7]):
            assert_frequencies(y[:, i, j], binomial_log_pmf(count, prob))


def test_an_invalid_parameter_draws_nan_and_leaves_its_neighbours_alone():
    x = draw(lambda: torch.poisson(torch.tensor([-1.0, math.nan, 0.0, 3.0])))
    assert torch.isnan(x[:2]).all() and x[2] == 0 and torch.isfinite(x[3])
    y = draw(lambda: torch.binomial(torch.tensor([-1.0, 5.0, 5.0, 5.0]), torch.tensor([0.5, 1.5, math.nan, 0.5])))
    assert torch.isnan(y[:3]).all() and 0 <= y[3] <= 5


def test_the_regimes_switch_where_the_module_says():
    assert random_counts.SMALL_MEAN == 10.0  # the parameters above straddle it
    assert math.exp(-random_counts.SMALL_MEAN) * random_counts.SMALL_MEAN ** random_counts.SMALL_TERMS / math.factorial(
        random_counts.SMALL_TERMS
    ) < 1e-11  # what inversion leaves out


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_poisson_and_binomial_in_a_step_are_keyed(backend):
    """Count noise in a loss (Poisson shot noise on the input, binomial thinning of it): the
    same state draws the same, the next step anew, and Inductor draws what eager draws."""
    model = torch.nn.Linear(6, 1)

    def loss_fn(params, batch):
        counts = D.Poisson(batch.exp()).sample()
        kept = D.Binomial(counts, probs=torch.full_like(counts, 0.8)).sample()
        rate = fsg.apply(model, params, kept).exp().squeeze(-1)
        return torch.nn.functional.poisson_nll_loss(rate, counts.sum(-1), log_input=False), {"kept": kept}

    batch = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
    kept = {}
    for b in ("eager", backend):
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1e-3), backend=b, donate=False)
        state = step.init(fsg.params(model), seed=5)
        _, first = step(state, batch)
        _, again = step(state, batch)
        assert torch.equal(first["kept"], again["kept"])
        new_state, _ = step(state, batch)
        _, later = step(new_state, batch)
        assert not torch.equal(first["kept"], later["kept"])
        assert torch.all(first["kept"] >= 0)
        kept[b] = first["kept"]
    assert torch.equal(kept["eager"], kept[backend])


@pytest.mark.parametrize("sample", [lambda: torch.poisson(torch.full((50000,), 10.0)),
                                    lambda: torch.binomial(torch.full((50000,), 20.0), torch.full((50000,), 0.5))])  # fmt: skip
def test_rejection_accepts_each_candidate_often_enough_that_all_failing_is_negligible(sample, monkeypatch):
    """At the smallest means the rejection regime serves (its worst acceptance), a candidate is
    accepted with probability >= 0.7, so all ``CANDIDATES`` fail with probability < 3e-13."""
    seen = []
    first_accepted = random_counts.first_accepted
    monkeypatch.setattr(random_counts, "first_accepted", lambda ok, k: seen.append(ok) or first_accepted(ok, k))
    draw(sample)
    (ok,) = seen
    assert ok.double().mean().item() >= 0.7
    assert 0.3**random_counts.CANDIDATES < 3e-13
