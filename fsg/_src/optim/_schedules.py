"""Learning-rate schedules: pure functions of the step tensor.

A schedule maps an integer count tensor to a float32 0-d tensor with torch ops only, so it is
traced into the step graph: changing the learning rate over a run never recompiles, and no
value goes through the host. Each also accepts a Python int, for plotting or testing.
"""

from __future__ import annotations

import math
from typing import Callable, Union

import torch

from fsg._src import checks

Schedule = Callable[[torch.Tensor], torch.Tensor]
ScalarOrSchedule = Union[float, Schedule]


def _as_float(count: torch.Tensor | int) -> torch.Tensor:
    if not isinstance(count, torch.Tensor):
        count = torch.tensor(count)
    return count.to(torch.float32)


def as_schedule(value: ScalarOrSchedule) -> Schedule:
    """Returns ``value`` if it is a schedule, else the constant schedule of ``value``."""
    return value if callable(value) else constant(float(value))


def constant(value: float) -> Schedule:
    """The schedule that is ``value`` at every step.

    Example:
      >>> fsg.optim.constant(0.1)(7)
      tensor(0.1000)
    """

    def schedule(count):
        return torch.full_like(_as_float(count), value)

    return schedule


def linear(init_value: float, end_value: float, transition_steps: int, *, transition_begin: int = 0) -> Schedule:
    """Goes linearly from ``init_value`` to ``end_value`` over ``transition_steps`` steps.

    Before ``transition_begin`` it is ``init_value``; after the transition, ``end_value``.

    Example:
      >>> fsg.optim.linear(0.0, 1.0, 10)(5)
      tensor(0.5000)
    """
    checks.real("linear(init_value=...)", init_value)
    checks.real("linear(end_value=...)", end_value)
    checks.integer("linear(transition_steps=...)", transition_steps, low=1, fix="transition_steps must be positive")
    checks.integer("linear(transition_begin=...)", transition_begin, low=0)

    def schedule(count):
        frac = torch.clamp((_as_float(count) - transition_begin) / transition_steps, 0.0, 1.0)
        return init_value + (end_value - init_value) * frac

    return schedule


def cosine(init_value: float, decay_steps: int, *, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    Example:
      >>> fsg.optim.cosine(1.0, 100)(50)
      tensor(0.5000)
    """
    checks.real("cosine(init_value=...)", init_value)
    checks.integer("cosine(decay_steps=...)", decay_steps, low=1, fix="decay_steps must be positive")
    checks.real("cosine(alpha=...)", alpha, low=0.0, high=1.0, fix="alpha is the final fraction of init_value")

    def schedule(count):
        frac = torch.clamp(_as_float(count) / decay_steps, 0.0, 1.0)
        cosine_decay = 0.5 * (1.0 + torch.cos(math.pi * frac))
        return init_value * ((1.0 - alpha) * cosine_decay + alpha)

    return schedule


def warmup_cosine(
    peak_value: float, *, warmup: int, total: int, init_value: float = 0.0, end_value: float = 0.0
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    Args:
      peak_value: the value reached at the end of warm-up.
      warmup: number of warm-up steps.
      total: total number of steps, warm-up included; the value is ``end_value`` after it.
      init_value: the value at step 0.
      end_value: the value at step ``total`` and after.

    Example:
      >>> s = fsg.optim.warmup_cosine(1.0, warmup=10, total=110)
      >>> float(s(5)), float(s(10)), float(s(110))
      (0.5, 1.0, 0.0)
    """
    for name, value in (("peak_value", peak_value), ("init_value", init_value), ("end_value", end_value)):
        checks.real(f"warmup_cosine({name}=...)", value)
    checks.integer("warmup_cosine(warmup=...)", warmup, low=0)
    checks.integer("warmup_cosine(total=...)", total, low=1)
    if not warmup < total:
        raise checks.fail(
            "warmup_cosine(warmup=..., total=...)", f"needs 0 <= warmup < total (total={total})", warmup,
            "total counts every step, the warm-up included",
        )

    def schedule(count):
        t = _as_float(count)
        warm = init_value + (peak_value - init_value) * torch.clamp(t / max(warmup, 1), 0.0, 1.0)
        frac = torch.clamp((t - warmup) / (total - warmup), 0.0, 1.0)
        decay = end_value + (peak_value - end_value) * 0.5 * (1.0 + torch.cos(math.pi * frac))
        return torch.where(t < warmup, warm, decay)

    return schedule


def piecewise(init_value: float, boundaries_and_scales: dict[int, float]) -> Schedule:
    """Piecewise constant: starts at ``init_value``; at each boundary step it is multiplied
    by that boundary's scale.

    Example:
      >>> s = fsg.optim.piecewise(1.0, {10: 0.1, 20: 0.1})
      >>> [round(float(s(t)), 4) for t in (0, 10, 25)]
      [1.0, 0.1, 0.01]
    """
    checks.real("piecewise(init_value=...)", init_value)
    checks.instance("piecewise(boundaries_and_scales=...)", boundaries_and_scales, dict, what="a dict {step: scale}",
                    fix="E.g. {10_000: 0.1, 20_000: 0.1}")  # fmt: skip
    for boundary, scale in boundaries_and_scales.items():
        checks.integer(f"piecewise: boundary {boundary!r}", boundary, low=0, fix="Boundaries are step counts")
        checks.real(f"piecewise: the scale at step {boundary}", scale)
    items = sorted(boundaries_and_scales.items())

    def schedule(count):
        t = _as_float(count)
        value = torch.full_like(t, init_value)
        for boundary, scale in items:
            value = torch.where(t >= boundary, value * scale, value)
        return value

    return schedule
