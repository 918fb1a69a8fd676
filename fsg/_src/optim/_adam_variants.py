"""Adam's relatives as ``torch.optim`` computes them: AMSGrad, NAdam, RAdam, Adamax and
Adadelta. Each ``scale_by_*`` is the scaling alone; the named optimizers chain it with weight
decay (L2: added to the gradient first, as torch's default; or decoupled where torch offers
``decoupled_weight_decay``) and the learning rate. Scalars (bias corrections, NAdam's momentum
schedule, RAdam's rectification) are computed in the graph from the update count, in float64
for float64 params (``scalar_dtype``) as torch computes them in Python floats."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsg._src import checks, tree
from fsg._src.optim import _checks
from fsg._src.optim._base import GradientTransformation, chain, scalar_dtype, zeros_count
from fsg._src.optim._schedules import ScalarOrSchedule
from fsg._src.optim._transforms import MaskOrFn, ScaleByAdamState, add_decayed_weights, scale_by_learning_rate


def _zeros(params: Any) -> Any:
    return tree.tree_map(torch.zeros_like, params)


def _moments(state: Any, updates: Any, b1: float, b2: float) -> tuple[Any, Any]:
    mu = tree.tree_map(lambda m, g: torch.lerp(m, g, 1.0 - b1), state.mu, updates)
    nu = tree.tree_map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, updates)
    return mu, nu


class ScaleByAmsgradState(NamedTuple):
    """State of ``scale_by_amsgrad``: Adam's, and the largest second moment so far."""

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any


def scale_by_amsgrad(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's scaling by the running maximum of the second moment (Reddi et al., 2018), as
    ``torch.optim.Adam(amsgrad=True)``.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_amsgrad(), fsg.optim.scale_by_learning_rate(1e-3))
    """
    adam_constants("scale_by_amsgrad", b1, b2, eps)

    def init(params):
        return ScaleByAmsgradState(zeros_count(params), _zeros(params), _zeros(params), _zeros(params))

    def update(updates, state, params=None):
        count = state.count + 1
        t = count.to(scalar_dtype(updates))
        bias1, bias2 = 1.0 - torch.pow(b1, t), 1.0 - torch.pow(b2, t)
        mu, nu = _moments(state, updates, b1, b2)
        nu_max = tree.tree_map(torch.maximum, state.nu_max, nu)
        new = tree.tree_map(lambda m, v: (m / bias1) / (v.sqrt() / bias2.sqrt() + eps), mu, nu_max)
        return new, ScaleByAmsgradState(count, mu, nu, nu_max)

    return GradientTransformation(init, update)


class ScaleByNadamState(NamedTuple):
    """State of ``scale_by_nadam``: the count, the product of the momentum schedule so far
    (float32, as torch keeps it), and the two moments."""

    count: torch.Tensor
    mu_product: torch.Tensor
    mu: Any
    nu: Any


def scale_by_nadam(
    *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, momentum_decay: float = 4e-3
) -> GradientTransformation:
    """Adam with Nesterov momentum and a momentum schedule (Dozat, 2016), as
    ``torch.optim.NAdam``: ``mu_t = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_nadam(), fsg.optim.scale_by_learning_rate(2e-3))
    """
    adam_constants("scale_by_nadam", b1, b2, eps)
    _checks.non_negative("scale_by_nadam(momentum_decay=...)", momentum_decay, fix="E.g. 4e-3")

    def init(params):
        one = torch.ones((), dtype=torch.float32, device=zeros_count(params).device)
        return ScaleByNadamState(zeros_count(params), one, _zeros(params), _zeros(params))

    def update(updates, state, params=None):
        count = state.count + 1
        t = count.to(scalar_dtype(updates))
        schedule = lambda step: b1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))  # noqa: E731
        mu_t, mu_next = schedule(t), schedule(t + 1)
        mu_product = state.mu_product * mu_t.float()  # torch: a float32 tensor times a Python float
        product = mu_product.to(t.dtype)
        bias2 = 1.0 - torch.pow(b2, t)
        mu, nu = _moments(state, updates, b1, b2)
        grad_coeff, mu_coeff = (1.0 - mu_t) / (1.0 - product), mu_next / (1.0 - product * mu_next)
        new = tree.tree_map(lambda g, m, v: (grad_coeff * g + mu_coeff * m) / ((v / bias2).sqrt() + eps), updates, mu, nu)
        return new, ScaleByNadamState(count, mu_product, mu, nu)

    return GradientTransformation(init, update)


def scale_by_radam(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rectified Adam (Liu et al., 2020), as ``torch.optim.RAdam``: the bias-corrected first
    moment, times Adam's adaptive factor and the variance rectification once the length of the
    approximated moving average ``rho_t`` exceeds 5; before that, the first moment alone.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_radam(), fsg.optim.scale_by_learning_rate(1e-3))
    """
    adam_constants("scale_by_radam", b1, b2, eps)
    rho_inf = 2.0 / (1.0 - b2) - 1.0

    def init(params):
        return ScaleByAdamState(zeros_count(params), _zeros(params), _zeros(params))

    def update(updates, state, params=None):
        count = state.count + 1
        t = count.double()  # rho_t cancels (rho_inf - ~rho_inf, near 5): float32 would be 1e-4 off
        bias1, bias2 = 1.0 - torch.pow(b1, t), 1.0 - torch.pow(b2, t)
        rho_t = rho_inf - 2.0 * t * torch.pow(b2, t) / bias2
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).clamp(min=0).sqrt()
        rectified = rho_t > 5.0
        dtype = scalar_dtype(updates)
        bias1, bias2, rect = bias1.to(dtype), bias2.to(dtype), rect.to(dtype)
        mu, nu = _moments(state, updates, b1, b2)
        new = tree.tree_map(
            lambda m, v: torch.where(rectified, (m / bias1) * (bias2.sqrt() / (v.sqrt() + eps)) * rect, m / bias1), mu, nu
        )
        return new, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


class ScaleByAdamaxState(NamedTuple):
    """State of ``scale_by_adamax``: the count, the first moment and the infinity norm."""

    count: torch.Tensor
    mu: Any
    inf_norm: Any


def scale_by_adamax(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's infinity-norm variant (Kingma & Ba, 2014), as ``torch.optim.Adamax``:
    ``u <- max(b2 * u, |g| + eps)``, the update ``(mu / (1 - b1**t)) / u``.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_adamax(), fsg.optim.scale_by_learning_rate(2e-3))
    """
    adam_constants("scale_by_adamax", b1, b2, eps)

    def init(params):
        return ScaleByAdamaxState(zeros_count(params), _zeros(params), _zeros(params))

    def update(updates, state, params=None):
        count = state.count + 1
        bias1 = 1.0 - torch.pow(b1, count.to(scalar_dtype(updates)))
        mu = tree.tree_map(lambda m, g: torch.lerp(m, g, 1.0 - b1), state.mu, updates)
        inf_norm = tree.tree_map(lambda u, g: torch.maximum(b2 * u, g.abs() + eps), state.inf_norm, updates)
        return tree.tree_map(lambda m, u: m / u / bias1, mu, inf_norm), ScaleByAdamaxState(count, mu, inf_norm)

    return GradientTransformation(init, update)


class ScaleByAdadeltaState(NamedTuple):
    """State of ``scale_by_adadelta``: running averages of squared gradients and of squared
    updates."""

    square_avg: Any
    acc_delta: Any


def scale_by_adadelta(*, rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Adadelta (Zeiler, 2012), as ``torch.optim.Adadelta``: each gradient times
    ``sqrt(acc_delta + eps) / sqrt(square_avg + eps)``.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_adadelta(), fsg.optim.scale_by_learning_rate(1.0))
    """
    _checks.beta("scale_by_adadelta(rho=...)", rho)
    _checks.eps("scale_by_adadelta(eps=...)", eps)

    def init(params):
        return ScaleByAdadeltaState(_zeros(params), _zeros(params))

    def update(updates, state, params=None):
        square_avg = tree.tree_map(lambda s, g: rho * s + (1 - rho) * g * g, state.square_avg, updates)
        delta = tree.tree_map(lambda a, s, g: (a + eps).sqrt() / (s + eps).sqrt() * g, state.acc_delta, square_avg, updates)
        acc_delta = tree.tree_map(lambda a, d: rho * a + (1 - rho) * d * d, state.acc_delta, delta)
        return delta, ScaleByAdadeltaState(square_avg, acc_delta)

    return GradientTransformation(init, update)


def nadam(
    learning_rate: ScalarOrSchedule = 2e-3,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum_decay: float = 4e-3,
    decoupled_weight_decay: bool = False,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """NAdam: matches ``torch.optim.NAdam`` with the same arguments (L2 weight decay unless
    ``decoupled_weight_decay``, then as AdamW's).

    Example:
      >>> opt = fsg.optim.nadam(2e-3, weight_decay=0.01, decoupled_weight_decay=True)
    """
    adam_constants("nadam", b1, b2, eps)
    scaling = scale_by_nadam(b1=b1, b2=b2, eps=eps, momentum_decay=momentum_decay)
    return _with_decay("nadam", scaling, learning_rate, weight_decay, decoupled_weight_decay, mask)


def radam(
    learning_rate: ScalarOrSchedule = 1e-3,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """RAdam: matches ``torch.optim.RAdam`` with the same arguments.

    Example:
      >>> opt = fsg.optim.radam(1e-3)
    """
    adam_constants("radam", b1, b2, eps)
    scaling = scale_by_radam(b1=b1, b2=b2, eps=eps)
    return _with_decay("radam", scaling, learning_rate, weight_decay, decoupled_weight_decay, mask)


def adamax(
    learning_rate: ScalarOrSchedule = 2e-3,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Adamax: matches ``torch.optim.Adamax`` with the same arguments (L2 weight decay).

    Example:
      >>> opt = fsg.optim.adamax(2e-3)
    """
    adam_constants("adamax", b1, b2, eps)
    return _with_decay("adamax", scale_by_adamax(b1=b1, b2=b2, eps=eps), learning_rate, weight_decay, False, mask)


def adadelta(
    learning_rate: ScalarOrSchedule = 1.0,
    *,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Adadelta: matches ``torch.optim.Adadelta`` with the same arguments (L2 weight decay).

    Example:
      >>> opt = fsg.optim.adadelta(1.0)
    """
    _checks.beta("adadelta(rho=...)", rho)
    _checks.eps("adadelta(eps=...)", eps)
    return _with_decay("adadelta", scale_by_adadelta(rho=rho, eps=eps), learning_rate, weight_decay, False, mask)


def _with_decay(
    name: str,
    scaling: GradientTransformation,
    learning_rate: ScalarOrSchedule,
    weight_decay: float,
    decoupled: bool,
    mask: MaskOrFn,
) -> GradientTransformation:
    """``scaling`` then the learning rate, with weight decay added to the gradient first (L2)
    or, ``decoupled``, to the scaled update (AdamW's)."""
    _checks.learning_rate(f"{name}(learning_rate=...)", learning_rate)
    _checks.non_negative(f"{name}(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    checks.flag(f"{name}(decoupled_weight_decay=...)", decoupled)
    if not weight_decay:
        return chain(scaling, scale_by_learning_rate(learning_rate))
    decay = add_decayed_weights(weight_decay, mask=mask)
    parts = (scaling, decay) if decoupled else (decay, scaling)
    return chain(*parts, scale_by_learning_rate(learning_rate))


def adam_constants(name: str, b1: float, b2: float, eps: float) -> None:
    _checks.beta(f"{name}(b1=...)", b1)
    _checks.beta(f"{name}(b2=...)", b2)
    _checks.eps(f"{name}(eps=...)", eps)
