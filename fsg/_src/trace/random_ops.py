"""The keyed versions of torch's random ops (``random.py``'s ``Keyed`` calls them in their
place): the same distributions, drawn from ``keys.bits`` (a hash of the step's key, the call
and the element), each registered for the aten overloads it replaces.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fsg._src.trace.random import Keyed, below, compute_dtype, first_accepted, normal, rewrite, shr, unit, unsupported

_aten = torch.ops.aten


def _dtype(kw: dict, like: Any = None, default: Any = None) -> torch.dtype:
    if kw.get("dtype") is not None:
        return kw["dtype"]
    return like.dtype if like is not None else (default or torch.get_default_dtype())


def _device(kw: dict, like: Any = None) -> Any:
    return kw["device"] if kw.get("device") is not None else (like.device if like is not None else None)


def _integers(z: torch.Tensor, low: Any, high: Any, dtype: torch.dtype) -> torch.Tensor:
    """Integers in ``[low, high)`` (the modulo's bias is below ``(high - low) / 2**63``)."""
    return (shr(z, 1) % (high - low) + low).to(dtype)


for _sample, _names in ((unit, ("rand", "rand_like")), (normal, ("randn", "randn_like"))):
    rewrite(f"{_names[0]}.default", f"{_names[0]}.generator")(
        lambda keys, size, _s=_sample, **kw: _s(keys.bits(size, _device(kw)), _dtype(kw))
    )
    rewrite(f"{_names[1]}.default", f"{_names[1]}.generator")(
        lambda keys, x, _s=_sample, **kw: _s(keys.bits(x.shape, _device(kw, x)), _dtype(kw, x))
    )


@rewrite("randint.default", "randint.generator", "randint.low", "randint.low_generator")
def _randint(keys: Keyed, *bounds_and_size, **kw):
    *bounds, size = bounds_and_size
    low, high = (0, *bounds) if len(bounds) == 1 else bounds
    return _integers(keys.bits(size, _device(kw)), low, high, _dtype(kw, default=torch.int64))


@rewrite("randint_like.default", "randint_like.generator", "randint_like.Tensor", "randint_like.low_dtype")
@rewrite("randint_like.low_generator_dtype")
def _randint_like(keys: Keyed, x, *bounds, **kw):
    low, high = (0, *bounds) if len(bounds) == 1 else bounds
    return _integers(keys.bits(x.shape, _device(kw, x)), low, high, _dtype(kw, x))


@rewrite("random_.to", "random_.from")
def _random_(keys: Keyed, x, *bounds):
    low, high = (0, *bounds) if len(bounds) == 1 else bounds
    if high is None:
        raise unsupported(_aten.random_.default, "it has no upper bound (pass to=)")
    return x.copy_(_integers(keys.bits(x.shape, x.device), low, high, x.dtype))


def _bernoulli(keys: Keyed, x: torch.Tensor, p: Any) -> torch.Tensor:
    """A tensor like ``x``, 1 with probability ``p`` (``x`` itself when ``p`` is None)."""
    return below(keys.bits(x.shape, x.device), x if p is None else p).to(x.dtype)


rewrite("bernoulli.default")(lambda keys, x: _bernoulli(keys, x, None))
rewrite("bernoulli.p", "bernoulli.Tensor")(lambda keys, x, p=0.5: _bernoulli(keys, x, p))
rewrite("bernoulli_.float", "bernoulli_.Tensor")(lambda keys, x, p=0.5: x.copy_(_bernoulli(keys, x, p)))


@rewrite("native_dropout.default")
def _native_dropout(keys: Keyed, x, p, train=None):
    if train is False or p == 0:  # what aten's kernel does: nothing drawn
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = below(keys.bits(x.shape, x.device), 1.0 - p)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * keep * scale, keep  # autograd's backward reads this mask


def _uniform(z, dtype, low=0.0, high=1.0):
    return unit(z, dtype) * (high - low) + low


def _normal(z, dtype, mean=0.0, std=1.0):
    return normal(z, dtype) * std + mean


def _exponential(z, dtype, lambd=1.0):
    return (-torch.log1p(-unit(z, compute_dtype(dtype))) / lambd).to(dtype)


def _log_normal(z, dtype, mean=1.0, std=2.0):
    return torch.exp(_normal(z, compute_dtype(dtype), mean, std)).to(dtype)


def _cauchy(z, dtype, median=0.0, sigma=1.0):
    return (median + sigma * torch.tan(math.pi * (unit(z, compute_dtype(dtype)) - 0.5))).to(dtype)


# Each distribution in place (``uniform_``) and functional (``uniform``, what functionalized
# code calls), drawn like its first argument.
for _sample, _functional, _in_place in (
    (_uniform, "uniform.default", "uniform_.default"),
    (_normal, "normal_functional.default", "normal_.default"),
    (_exponential, "exponential.default", "exponential_.default"),
    (_log_normal, "log_normal.default", "log_normal_.default"),
    (_cauchy, "cauchy.default", "cauchy_.default"),
):
    rewrite(_functional)(lambda keys, x, *a, _s=_sample: _s(keys.bits(x.shape, x.device), x.dtype, *a))
    rewrite(_in_place)(lambda keys, x, *a, _s=_sample: x.copy_(_s(keys.bits(x.shape, x.device), x.dtype, *a)))


@rewrite("normal.Tensor_float", "normal.float_Tensor", "normal.Tensor_Tensor")
def _normal_tensors(keys: Keyed, mean, std=1.0):
    like = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in like))
    return normal(keys.bits(shape, like[0].device), like[0].dtype) * std + mean


@rewrite("normal.float_float")
def _normal_floats(keys: Keyed, mean, std, size, **kw):
    return normal(keys.bits(size, _device(kw)), _dtype(kw)) * std + mean



@rewrite("multinomial.default")
def _multinomial(keys: Keyed, weights: torch.Tensor, num_samples: int, replacement: bool = False) -> torch.Tensor:
    """Category indices drawn with probability proportional to ``weights`` (``[n]`` or
    ``[rows, n]``; what ``Categorical.sample()`` calls). With replacement (or one sample): the
    inverse of the cumulative distribution at a keyed uniform (a category of weight 0 is never
    drawn); without: Gumbel top-k, the ``num_samples`` largest ``log w + Gumbel`` (distinct
    categories, drawn in order of their perturbed weight, as sequential sampling would)."""
    shape = (*weights.shape[:-1], num_samples)
    w = weights.to(compute_dtype(weights.dtype))
    u = unit(keys.bits(shape, weights.device), w.dtype)
    if replacement or num_samples == 1:
        cdf = torch.cumsum(w, -1)
        target = u * cdf[..., -1:]
        index = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True)
        return index.clamp(max=weights.shape[-1] - 1)
    gumbel = -torch.log(-torch.log(unit(keys.bits(weights.shape, weights.device), w.dtype).clamp(min=1e-20)))
    return torch.topk(torch.log(w) + gumbel, num_samples, dim=-1).indices


@rewrite("randperm.default", "randperm.generator")
def _randperm(keys: Keyed, n, **kw):
    """A permutation of ``0..n-1``: the order of ``n`` keyed 64-bit words (distinct but with
    probability ``n**2 / 2**65``; a tie keeps index order), uniform over the permutations."""
    order = torch.argsort(keys.bits((n,), _device(kw)), stable=True)
    return order.to(kw.get("dtype") or torch.int64)


def _geometric(z, dtype, p):
    """The number of Bernoulli(``p``) trials to the first success (1, 2, ...): inverse CDF."""
    u = 1.0 - unit(z, compute_dtype(dtype))  # (0, 1]
    return torch.ceil(torch.log(u) / math.log1p(-p) if p < 1 else torch.zeros_like(u)).clamp(min=1).to(dtype)


rewrite("geometric.default")(lambda keys, x, p: _geometric(keys.bits(x.shape, x.device), x.dtype, p))
rewrite("geometric_.default")(lambda keys, x, p: x.copy_(_geometric(keys.bits(x.shape, x.device), x.dtype, p)))


def _rrelu_noise(keys: Keyed, x, lower, upper):
    """RReLU's slopes in training: uniform in ``[lower, upper]`` where ``x <= 0``, 1 elsewhere."""
    slope = _uniform(keys.bits(x.shape, x.device), compute_dtype(x.dtype), lower, upper).to(x.dtype)
    return torch.where(x <= 0, slope, torch.ones_like(slope))


@rewrite("rrelu_with_noise.default")
def _rrelu(keys: Keyed, x, noise, lower=1 / 8, upper=1 / 3, training=False):
    noise.copy_(_rrelu_noise(keys, x, lower, upper))  # rrelu_with_noise_backward reads it
    return x * noise


@rewrite("rrelu_with_noise_.default")
def _rrelu_(keys: Keyed, x, noise, lower=1 / 8, upper=1 / 3, training=False):
    noise.copy_(_rrelu_noise(keys, x, lower, upper))
    return x.mul_(noise)


@rewrite("rrelu_with_noise_functional.default")
def _rrelu_functional(keys: Keyed, x, noise, lower=1 / 8, upper=1 / 3, training=False):
    new_noise = _rrelu_noise(keys, x, lower, upper)
    return x * new_noise, new_noise


GAMMA_CANDIDATES = 16  # Marsaglia-Tsang accepts each with probability >= 0.95: all 16 fail < 1e-20


@rewrite("_standard_gamma.default")
def _standard_gamma(keys: Keyed, alpha: torch.Tensor) -> torch.Tensor:
    """Gamma(``alpha``, 1) draws (what ``Gamma``, ``Beta``, ``Dirichlet``, ``Chi2``, ``StudentT``
    sample; their gradients are aten's): Marsaglia and Tsang's squeeze method over
    ``GAMMA_CANDIDATES`` keyed candidates per element, the first accepted taken, and for
    ``alpha < 1`` the boost ``Gamma(alpha + 1) * U ** (1 / alpha)``."""
    dtype = compute_dtype(alpha.dtype)
    a = alpha.to(dtype)
    boosted = torch.where(a < 1, a + 1, a)
    d = (boosted - 1.0 / 3.0).unsqueeze(-1)
    c = 1.0 / torch.sqrt(9.0 * d)
    shape = (*alpha.shape, GAMMA_CANDIDATES)
    x = normal(keys.bits(shape, alpha.device), dtype)
    u = 1.0 - unit(keys.bits(shape, alpha.device), dtype)  # (0, 1]
    v = (1.0 + c * x) ** 3
    ok = (v > 0) & (torch.log(u) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp(min=1e-30)))
    draw = first_accepted(ok, d * v)
    boost = (1.0 - unit(keys.bits(alpha.shape, alpha.device), dtype)) ** (1.0 / a)
    draw = torch.where(a < 1, draw * boost, draw)
    return draw.clamp(min=torch.finfo(alpha.dtype).tiny).to(alpha.dtype)


@rewrite("_sample_dirichlet.default")
def _sample_dirichlet(keys: Keyed, alpha: torch.Tensor) -> torch.Tensor:
    """Dirichlet(``alpha``) draws along the last dim (``Beta`` samples through it): normalized
    Gamma draws."""
    g = _standard_gamma(keys, alpha)
    return g / g.sum(-1, keepdim=True)
