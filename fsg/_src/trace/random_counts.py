"""The keyed count samplers: ``torch.poisson`` (``Poisson.sample``) and ``torch.binomial``
(``Binomial.sample``), drawn from ``keys.bits`` like ``random_ops.py``'s, with no data-dependent
loop: a static graph draws a fixed number of candidates per element.

Each distribution has two regimes, computed for every element and selected per element:

- a small mean (below ``SMALL_MEAN``): inversion, the number of cumulative probabilities
  ``P(X <= k)``, ``k < SMALL_TERMS``, that a keyed uniform exceeds (what lies beyond the last
  term has probability below 1e-11 for these means);
- a large mean: Hoermann's transformed rejection with squeeze (PTRS for Poisson, BTRS for the
  binomial, as numpy and torch sample them), ``CANDIDATES`` keyed candidates per element and the
  first accepted taken. Each is accepted with probability >= 0.7 (measured over 100,000: 0.71 for
  Binomial(20, 1/2), 0.75 for Poisson(10), 0.89 for means of a million), so all 24 fail with
  probability < 3e-13; then the first candidate is taken, clamped to the support.

Both work in float64 (``lgamma`` of large counts needs its precision) and return the input's
dtype. An invalid parameter (a negative or NaN rate, a count below 0, a probability outside
[0, 1]) gives NaN: torch raises there, which a compiled graph cannot do from a value.
"""

from __future__ import annotations

import torch

from fsg._src.trace.random import Keyed, first_accepted, rewrite, unit

SMALL_MEAN = 10.0
SMALL_TERMS = 48
CANDIDATES = 24  # accepted with probability >= 0.7 each: all fail with probability < 3e-13
_F64 = torch.float64


def _uniforms(keys: Keyed, shape: tuple, device, n: int) -> torch.Tensor:
    return unit(keys.bits((*shape, n), device), _F64)


def _inversion(keys: Keyed, log_pmf: torch.Tensor) -> torch.Tensor:
    """The count ``k`` with ``P(X < k) <= u < P(X <= k)`` for a keyed uniform ``u``, given
    ``log P(X = k)`` for ``k < SMALL_TERMS`` along the last dim."""
    cdf = torch.cumsum(torch.exp(log_pmf), -1)
    u = _uniforms(keys, log_pmf.shape[:-1], log_pmf.device, 1)
    return (cdf <= u).sum(-1).to(_F64)


def _terms(like: torch.Tensor) -> torch.Tensor:
    return torch.arange(SMALL_TERMS, dtype=_F64, device=like.device)


def _transformed_rejection(keys: Keyed, shape: tuple, device, b, a, c, accept) -> torch.Tensor:
    """Hoermann's transformed rejection with squeeze: candidates ``k = floor((2a / us + b) U + c)``
    from keyed uniforms ``U`` in (-0.5, 0.5) and ``V``; ``accept(k, us, v)`` decides each. The
    parameters broadcast against ``(*shape, CANDIDATES)``."""
    uv = _uniforms(keys, shape, device, 2 * CANDIDATES)
    u, v = uv[..., :CANDIDATES] - 0.5, uv[..., CANDIDATES:]
    us = (0.5 - u.abs()).clamp(min=1e-12)
    k = torch.floor((2 * a / us + b) * u + c)
    return first_accepted(accept(k, us, v), k)


@rewrite("poisson.default")
def _poisson(keys: Keyed, rates: torch.Tensor) -> torch.Tensor:
    """Poisson(``rates``) counts, as floats of the rates' dtype."""
    lam = rates.detach().to(_F64)
    valid = lam >= 0  # False for NaN
    lam = torch.where(valid, lam, torch.zeros_like(lam))
    k = _terms(lam)
    s = lam.clamp(max=SMALL_MEAN).unsqueeze(-1)  # xlogy: 0 * log 0 = 0, so a zero rate draws 0
    small = _inversion(keys, -s + torch.xlogy(k, s) - torch.lgamma(k + 1))
    big = lam.clamp(min=SMALL_MEAN).unsqueeze(-1)
    b = 0.931 + 2.53 * torch.sqrt(big)
    a = -0.059 + 0.02483 * b
    inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
    vr = 0.9277 - 3.6224 / (b - 2)

    def accept(k, us, v):
        quick = (us >= 0.07) & (v <= vr)
        kk = k.clamp(min=0)
        log_ratio = torch.log(v * inv_alpha / (a / (us * us) + b))
        exact = ~((us < 0.013) & (v > us)) & (log_ratio <= -big + torch.xlogy(kk, big) - torch.lgamma(kk + 1))
        return (k >= 0) & (quick | exact)

    large = _transformed_rejection(keys, lam.shape, lam.device, b, a, big + 0.43, accept).clamp(min=0)
    draw = torch.where(lam < SMALL_MEAN, small, large)
    return torch.where(valid, draw, torch.full_like(draw, float("nan"))).to(rates.dtype)


def _log_binomial(n, k, q):
    """log P(X = k) for X ~ Binomial(n, q) (-inf outside 0..n)."""
    inside = (k >= 0) & (k <= n)
    kk = torch.where(inside, k, torch.zeros_like(k))
    log = torch.lgamma(n + 1) - torch.lgamma(kk + 1) - torch.lgamma(n - kk + 1)
    log = log + torch.xlogy(kk, q) + (n - kk) * torch.log1p(-q)
    return torch.where(inside, log, torch.full_like(log, -float("inf")))


@rewrite("binomial.default")
def _binomial(keys: Keyed, count: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """Binomial(``count``, ``prob``) successes, as floats of the count's dtype: drawn for
    ``q = min(prob, 1 - prob)`` and reflected (``count - X``) where ``prob > 1/2``."""
    n, p = torch.broadcast_tensors(count.detach().to(_F64), prob.detach().to(_F64))
    valid = (n >= 0) & (p >= 0) & (p <= 1)  # False for NaN
    n = torch.where(valid, torch.floor(n), torch.zeros_like(n))
    p = torch.where(valid, p, torch.zeros_like(p))
    flip = p > 0.5
    q = torch.where(flip, 1 - p, p)
    mean = n * q
    small_q = torch.where(mean < SMALL_MEAN, q, torch.zeros_like(q)).unsqueeze(-1)
    small = torch.minimum(_inversion(keys, _log_binomial(n.unsqueeze(-1), _terms(n), small_q)), n)
    # large means: BTRS (Hoermann 1993), for n * q >= SMALL_MEAN (so q > 0 and n >= 20)
    nb = n.unsqueeze(-1)
    qb = torch.where(mean >= SMALL_MEAN, q, torch.full_like(q, 0.5)).unsqueeze(-1)
    nb = torch.where(mean.unsqueeze(-1) >= SMALL_MEAN, nb, torch.full_like(nb, 2 * SMALL_MEAN))
    spq = torch.sqrt(nb * qb * (1 - qb))
    b = 1.15 + 2.53 * spq
    a = -0.0873 + 0.0248 * b + 0.01 * qb
    alpha = (2.83 + 5.1 / b) * spq
    vr = 0.92 - 4.2 / b
    m = torch.floor((nb + 1) * qb)
    log_mode = _log_binomial(nb, m, qb)

    def accept(k, us, v):
        inside = (k >= 0) & (k <= nb)
        quick = (us >= 0.07) & (v <= vr)
        exact = torch.log(v * alpha / (a / (us * us) + b)) <= _log_binomial(nb, k, qb) - log_mode
        return inside & (quick | exact)

    large = _transformed_rejection(keys, n.shape, n.device, b, a, nb * qb + 0.5, accept)
    large = torch.minimum(large.clamp(min=0), n)
    draw = torch.where(mean < SMALL_MEAN, small, large)
    draw = torch.where(flip, n - draw, draw)
    return torch.where(valid, draw, torch.full_like(draw, float("nan"))).to(count.dtype)
