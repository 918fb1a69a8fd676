"""Every distribution in ``torch.distributions`` samples inside a compiled step (``VonMises``
and ``Wishart`` through the static samplers ``trace_fake`` swaps in): the samples come from the step's key (the same state draws
the same, the next state anew), lie in the distribution's support, and have its mean (within 6
standard errors, where the mean and variance are finite and implemented). A distribution added
to torch fails ``test_the_corpus_covers_every_distribution`` until it is given a case here."""

import math

import pytest
import torch
from torch import distributions as D

import fsg

N = 4000
t = torch.tensor
CASES = {
    "Bernoulli": lambda: D.Bernoulli(probs=t(0.3)),
    "Beta": lambda: D.Beta(t(2.0), t(3.0)),
    "Binomial": lambda: D.Binomial(10, probs=t(0.3)),
    "Categorical": lambda: D.Categorical(probs=t([0.2, 0.3, 0.5])),
    "Cauchy": lambda: D.Cauchy(t(0.0), t(1.0)),
    "Chi2": lambda: D.Chi2(t(3.0)),
    "ContinuousBernoulli": lambda: D.ContinuousBernoulli(probs=t(0.3)),
    "Dirichlet": lambda: D.Dirichlet(t([1.0, 2.0, 3.0])),
    "Exponential": lambda: D.Exponential(t(2.0)),
    "FisherSnedecor": lambda: D.FisherSnedecor(t(5.0), t(9.0)),
    "Gamma": lambda: D.Gamma(t(2.0), t(3.0)),
    "GeneralizedPareto": lambda: D.GeneralizedPareto(t(0.0), t(1.0), t(0.2)),
    "Geometric": lambda: D.Geometric(probs=t(0.3)),
    "Gumbel": lambda: D.Gumbel(t(0.0), t(1.0)),
    "HalfCauchy": lambda: D.HalfCauchy(t(1.0)),
    "HalfNormal": lambda: D.HalfNormal(t(1.0)),
    "Independent": lambda: D.Independent(D.Normal(torch.zeros(3), torch.ones(3)), 1),
    "InverseGamma": lambda: D.InverseGamma(t(5.0), t(2.0)),
    "Kumaraswamy": lambda: D.Kumaraswamy(t(2.0), t(3.0)),
    "LKJCholesky": lambda: D.LKJCholesky(3, t(2.0)),
    "Laplace": lambda: D.Laplace(t(0.0), t(1.0)),
    "LogNormal": lambda: D.LogNormal(t(0.0), t(0.5)),
    "LogisticNormal": lambda: D.LogisticNormal(torch.zeros(2), torch.ones(2)),
    "LowRankMultivariateNormal": lambda: D.LowRankMultivariateNormal(torch.zeros(3), torch.ones(3, 1), torch.ones(3)),
    "MixtureSameFamily": lambda: D.MixtureSameFamily(D.Categorical(probs=t([0.3, 0.7])), D.Normal(t([-1.0, 1.0]), t([0.5, 0.5]))),
    "Multinomial": lambda: D.Multinomial(10, probs=t([0.2, 0.3, 0.5])),
    "MultivariateNormal": lambda: D.MultivariateNormal(torch.zeros(3), torch.eye(3) * 2),
    "NegativeBinomial": lambda: D.NegativeBinomial(t(5.0), probs=t(0.4)),
    "Normal": lambda: D.Normal(t(0.0), t(1.0)),
    "OneHotCategorical": lambda: D.OneHotCategorical(probs=t([0.2, 0.3, 0.5])),
    "OneHotCategoricalStraightThrough": lambda: D.OneHotCategoricalStraightThrough(probs=t([0.2, 0.3, 0.5])),
    "Pareto": lambda: D.Pareto(t(1.0), t(5.0)),
    "Poisson": lambda: D.Poisson(t(4.0)),
    "RelaxedBernoulli": lambda: D.RelaxedBernoulli(t(0.5), probs=t(0.3)),
    "RelaxedOneHotCategorical": lambda: D.RelaxedOneHotCategorical(t(0.5), probs=t([0.2, 0.3, 0.5])),
    "StudentT": lambda: D.StudentT(t(5.0)),
    "Uniform": lambda: D.Uniform(t(0.0), t(2.0)),
    "VonMises": lambda: D.VonMises(t(1.0), t(2.0)),
    "Weibull": lambda: D.Weibull(t(1.0), t(2.0)),
    "Wishart": lambda: D.Wishart(t(5.0), covariance_matrix=torch.eye(2)),
}  # fmt: skip


def _distribution_classes() -> set:
    return {n for n in dir(D) if isinstance(getattr(D, n), type) and issubclass(getattr(D, n), D.Distribution)}


def test_the_corpus_covers_every_distribution():
    abstract = {"Distribution", "ExponentialFamily", "TransformedDistribution"}
    assert _distribution_classes() - abstract - set(CASES) == set()


def _step(make):
    def loss_fn(params, batch):
        return (params["w"] * batch).sum(), {"s": make().sample((N,))}

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager", donate=False)
    return step, step.init({"w": torch.ones(1)}, seed=11)


def _mean_and_variance(d):
    try:
        mean, var = d.mean.double(), d.variance.double()
    except NotImplementedError:
        return None
    return (mean, var) if torch.isfinite(mean).all() and torch.isfinite(var).all() else None


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_distribution_samples_from_the_steps_key(name):
    make = CASES[name]
    step, state = _step(make)
    batch = torch.ones(1)
    new_state, first = step(state, batch)
    _, again = step(state, batch)
    _, later = step(new_state, batch)
    s = first["s"]
    assert torch.equal(s, again["s"]), "the same state drew different samples"
    assert not torch.equal(s, later["s"]), "the next state drew the same samples"
    d = make()
    assert s.shape == (N, *d.batch_shape, *d.event_shape)
    assert bool(d.support.check(s).all()), f"samples outside {d.support}"
    if name == "VonMises":  # circular: the mean direction and the mean resultant length I1/I0
        resultant = torch.stack([s.double().cos().mean(), s.double().sin().mean()])
        kappa = d.concentration.double()
        assert abs(math.atan2(resultant[1], resultant[0]) - d.loc.item()) < 0.05
        assert abs(resultant.norm().item() - (torch.special.i1e(kappa) / torch.special.i0e(kappa)).item()) < 0.02
        return
    moments = _mean_and_variance(d)
    if moments is not None:
        mean, var = moments
        error = (s.double().mean(0) - mean).abs()
        assert torch.all(error <= 6 * torch.sqrt(var / N) + 1e-9), (error, var)


@pytest.mark.parametrize("kappa", [1.0, 5.0, 50.0, 1e4])
def test_von_mises_fixed_candidates_all_fail_with_negligible_probability(kappa):
    """Best and Fisher's acceptance falls with the concentration towards ~0.658; at >= 0.65 the
    ``VON_MISES_CANDIDATES`` all fail with probability < 1e-14."""
    from fsg._src import decompositions

    d = D.VonMises(torch.tensor(0.0), torch.tensor(kappa))
    u1, u2 = torch.rand(2, 200000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    r, z = d._proposal_r, torch.cos(math.pi * u1)
    f = (1 + r * z) / (r + z)
    c = d._concentration * (r - f)
    accepted = (((c * (2 - c) - u2) > 0) | ((c / u2).log() + 1 - c >= 0)).double().mean().item()
    assert accepted >= 0.65
    assert (1 - 0.65) ** decompositions.VON_MISES_CANDIDATES < 1e-14
