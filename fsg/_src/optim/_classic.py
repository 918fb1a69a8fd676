"""RMSprop and Adagrad, as ``torch.optim`` computes them (their weight decay is L2: added to
the gradient before the scaling, not decoupled)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsg._src import checks, tree
from fsg._src.optim import _checks
from fsg._src.optim._base import GradientTransformation, chain
from fsg._src.optim._schedules import ScalarOrSchedule
from fsg._src.optim._transforms import add_decayed_weights, scale_by_learning_rate, trace


class ScaleByRmsState(NamedTuple):
    """State of ``scale_by_rms``: the average of squared gradients, and of gradients when
    centered (``None``-free: zeros when not)."""

    square_avg: Any
    grad_avg: Any


class ScaleByRssState(NamedTuple):
    """State of ``scale_by_rss``: the sum of squared gradients."""

    sum_of_squares: Any


def scale_by_rms(*, alpha: float = 0.99, eps: float = 1e-8, centered: bool = False) -> GradientTransformation:
    """Divides each gradient by the root of its running mean square (plus ``eps``), as
    ``torch.optim.RMSprop``; ``centered`` subtracts the square of the running mean first.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_rms(), fsg.optim.scale_by_learning_rate(1e-2))
    """
    _checks.beta("scale_by_rms(alpha=...)", alpha)
    _checks.eps("scale_by_rms(eps=...)", eps)
    checks.flag("scale_by_rms(centered=...)", centered)

    def init(params: Any) -> ScaleByRmsState:
        zeros = tree.tree_map(torch.zeros_like, params)
        return ScaleByRmsState(zeros, tree.tree_map(torch.zeros_like, params) if centered else {})

    def update(updates: Any, state: ScaleByRmsState, params: Any = None) -> tuple[Any, ScaleByRmsState]:
        square_avg = tree.tree_map(lambda s, g: alpha * s + (1 - alpha) * g * g, state.square_avg, updates)
        if not centered:
            return tree.tree_map(lambda g, s: g / (s.sqrt() + eps), updates, square_avg), ScaleByRmsState(square_avg, {})
        grad_avg = tree.tree_map(lambda a, g: torch.lerp(a, g, 1 - alpha), state.grad_avg, updates)
        new = tree.tree_map(lambda g, s, a: g / ((s - a * a).sqrt() + eps), updates, square_avg, grad_avg)
        return new, ScaleByRmsState(square_avg, grad_avg)

    return GradientTransformation(init, update)


def scale_by_rss(*, initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> GradientTransformation:
    """Divides each gradient by the root of the sum of its squares so far (plus ``eps``), as
    ``torch.optim.Adagrad``.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_rss(), fsg.optim.scale_by_learning_rate(1e-2))
    """
    _checks.non_negative("scale_by_rss(initial_accumulator_value=...)", initial_accumulator_value)
    _checks.eps("scale_by_rss(eps=...)", eps)

    def init(params: Any) -> ScaleByRssState:
        return ScaleByRssState(tree.tree_map(lambda p: torch.full_like(p, initial_accumulator_value), params))

    def update(updates: Any, state: ScaleByRssState, params: Any = None) -> tuple[Any, ScaleByRssState]:
        sums = tree.tree_map(lambda s, g: s + g * g, state.sum_of_squares, updates)
        return tree.tree_map(lambda g, s: g / (s.sqrt() + eps), updates, sums), ScaleByRssState(sums)

    return GradientTransformation(init, update)


def rmsprop(
    learning_rate: ScalarOrSchedule,
    *,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
) -> GradientTransformation:
    """RMSprop: matches ``torch.optim.RMSprop`` with the same arguments.

    Example:
      >>> opt = fsg.optim.rmsprop(1e-3, momentum=0.9)
    """
    _checks.learning_rate("rmsprop(learning_rate=...)", learning_rate)
    _checks.non_negative("rmsprop(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    _checks.non_negative("rmsprop(momentum=...)", momentum, fix="Pass 0.0 for no momentum")
    parts = [add_decayed_weights(weight_decay)] if weight_decay else []
    parts.append(scale_by_rms(alpha=alpha, eps=eps, centered=centered))
    if momentum:
        parts.append(trace(decay=momentum))
    return chain(*parts, scale_by_learning_rate(learning_rate))


def adagrad(
    learning_rate: float,
    *,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
) -> GradientTransformation:
    """Adagrad: matches ``torch.optim.Adagrad`` with the same arguments (``lr_decay`` divides
    the learning rate of update ``t`` by ``1 + t * lr_decay``, ``t`` from 0).

    Example:
      >>> opt = fsg.optim.adagrad(1e-2)
    """
    _checks.learning_rate("adagrad(learning_rate=...)", learning_rate)
    _checks.non_negative("adagrad(lr_decay=...)", lr_decay)
    _checks.non_negative("adagrad(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    if lr_decay and callable(learning_rate):
        raise checks.fail("adagrad(lr_decay=...)", "needs a float learning rate", learning_rate,
                          "Fold the decay into the schedule instead")  # fmt: skip
    lr = (lambda count: learning_rate / (1 + count.double() * lr_decay)) if lr_decay else learning_rate  # noqa: E731
    parts = [add_decayed_weights(weight_decay)] if weight_decay else []
    parts.append(scale_by_rss(initial_accumulator_value=initial_accumulator_value, eps=eps))
    return chain(*parts, scale_by_learning_rate(lr))
