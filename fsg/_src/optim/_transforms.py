"""Elementary gradient transformations; the named optimizers chain them."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import torch

from fsg._src import checks, tree
from fsg._src.errors import ArgumentError
from fsg._src.optim import _checks
from fsg._src.optim._base import EmptyState, GradientTransformation, scalar_dtype, zeros_count
from fsg._src.optim._schedules import ScalarOrSchedule, as_schedule

MaskOrFn = Union[Any, Callable[[Any], Any], None]


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``: update count and the two moment estimates."""

    count: torch.Tensor
    mu: Any
    nu: Any


def scale_by_adam(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescales updates by Adam's bias-corrected moment estimates (Kingma & Ba, 2014).

    Example:
      >>> opt = fsg.optim.scale_by_adam(b1=0.9)
    """
    _checks.beta("scale_by_adam(b1=...)", b1)
    _checks.beta("scale_by_adam(b2=...)", b2)
    _checks.eps("scale_by_adam(eps=...)", eps)

    def init(params):
        zeros = tree.tree_map(torch.zeros_like, params)
        return ScaleByAdamState(zeros_count(params), zeros, tree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        count = state.count + 1
        t = count.to(scalar_dtype(updates))
        bias1 = 1.0 - torch.pow(b1, t)
        bias2 = 1.0 - torch.pow(b2, t)
        mu = tree.tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, updates)
        nu = tree.tree_map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, updates)
        new_updates = tree.tree_map(lambda m, v: (m / bias1) / (torch.sqrt(v / bias2) + eps), mu, nu)
        return new_updates, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


class ScaleByLionState(NamedTuple):
    """State of ``scale_by_lion``: update count and the momentum."""

    count: torch.Tensor
    mu: Any


def scale_by_lion(*, b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """The sign update of Lion (Chen et al., 2023, "Symbolic Discovery of Optimization
    Algorithms"): ``sign(b1 * mu + (1 - b1) * g)``, then ``mu <- b2 * mu + (1 - b2) * g``.

    Example:
      >>> opt = fsg.optim.scale_by_lion(b1=0.9, b2=0.99)
    """
    _checks.beta("scale_by_lion(b1=...)", b1)
    _checks.beta("scale_by_lion(b2=...)", b2)

    def init(params):
        return ScaleByLionState(zeros_count(params), tree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        new_updates = tree.tree_map(lambda m, g: torch.sign(b1 * m + (1.0 - b1) * g), state.mu, updates)
        mu = tree.tree_map(lambda m, g: b2 * m + (1.0 - b2) * g, state.mu, updates)
        return new_updates, ScaleByLionState(state.count + 1, mu)

    return GradientTransformation(init, update)


class TraceState(NamedTuple):
    """State of ``trace``: the momentum buffer."""

    trace: Any


class DampedTraceState(NamedTuple):
    """State of ``trace`` with ``dampening``: the update count (the first step fills the buffer
    undamped) and the momentum buffer."""

    count: torch.Tensor
    trace: Any


def trace(*, decay: float, nesterov: bool = False, dampening: float = 0.0) -> GradientTransformation:
    """Heavy-ball momentum: ``t <- decay * t + (1 - dampening) * g`` (``t <- g`` on the first
    step); the update is ``t`` (or, with ``nesterov``, ``g + decay * t``), matching
    ``torch.optim.SGD``.

    Example:
      >>> opt = fsg.optim.trace(decay=0.9, nesterov=True)
    """
    _checks.non_negative("trace(decay=...)", decay, fix="Pass a momentum such as 0.9")
    checks.flag("trace(nesterov=...)", nesterov)
    _checks.non_negative("trace(dampening=...)", dampening, fix="Pass 0.0 for none")

    def init(params):
        zeros = tree.tree_map(torch.zeros_like, params)
        return DampedTraceState(zeros_count(params), zeros) if dampening else TraceState(zeros)

    def update(updates, state, params=None):
        if dampening:  # (t starts at 0: without dampening, g + decay * 0 is the first step's g)
            first = state.count == 0
            new_trace = tree.tree_map(lambda t, g: torch.where(first, g, decay * t + (1 - dampening) * g), state.trace, updates)
        else:
            new_trace = tree.tree_map(lambda t, g: g + decay * t, state.trace, updates)
        new_updates = tree.tree_map(lambda t, g: g + decay * t, new_trace, updates) if nesterov else new_trace
        return new_updates, (DampedTraceState(state.count + 1, new_trace) if dampening else TraceState(new_trace))

    return GradientTransformation(init, update)


def _resolve_mask(mask: MaskOrFn, params: Any) -> Any:
    if not callable(mask):
        return mask
    try:
        return mask(params)
    except Exception as exc:
        if not any(isinstance(leaf, tree.MaskedNode) for leaf in tree.flatten_masked(params)[0]):
            raise
        raise ArgumentError(
            f"add_decayed_weights(mask=...) (adamw, lion): the mask function raised {type(exc).__name__}: {exc}. Inside fsg.optim.multi_transform it is given the "
            f"params with the other groups' leaves replaced by fsg.optim.MaskedNode(), which has no .ndim or .shape. "
            f"Give the parameters not to decay a group of their own (weight_decay=0.0) instead of a mask, or skip "
            f"MaskedNode in the function"
        ) from exc


def add_decayed_weights(weight_decay: float = 0.0, *, mask: MaskOrFn = None) -> GradientTransformation:
    """Adds ``weight_decay * param`` to each update (decoupled weight decay, Loshchilov &
    Hutter, 2019, when placed after the scaling and before the learning rate).

    Args:
      weight_decay: the coefficient.
      mask: optional pytree of bools shaped like the params, or a function of the params that
        returns one; leaves marked ``False`` are not decayed (biases, norms).

    Example:
      >>> no_1d = lambda params: {k: v.ndim >= 2 for k, v in params.items()}
      >>> opt = fsg.optim.add_decayed_weights(0.1, mask=no_1d)
    """
    _checks.non_negative("add_decayed_weights(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")

    def init(params):
        if mask is not None:  # checked here, once, against the params the state is built for
            _checks.mask("add_decayed_weights(mask=...)", _resolve_mask(mask, params), params)
        return EmptyState()

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
        if weight_decay == 0.0:
            return updates, state
        if mask is None:
            return tree.tree_map(lambda u, p: u + weight_decay * p, updates, params), state
        flags = _resolve_mask(mask, params)
        new_updates = tree.tree_map(lambda u, p, keep: u + weight_decay * p if keep else u, updates, params, flags)
        return new_updates, state

    return GradientTransformation(init, update)


def scale(factor: float) -> GradientTransformation:
    """Multiplies every update by a constant ``factor``.

    Example:
      >>> opt = fsg.optim.scale(-0.5)
    """
    checks.real("scale(factor=...)", factor)

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        return tree.tree_map(lambda u: factor * u, updates), state

    return GradientTransformation(init, update)


class ScaleByScheduleState(NamedTuple):
    """State of ``scale_by_schedule``: the update count the schedule reads."""

    count: torch.Tensor


def scale_by_schedule(schedule: ScalarOrSchedule) -> GradientTransformation:
    """Multiplies every update by ``schedule(count)``, read from the count tensor in the graph.

    Example:
      >>> opt = fsg.optim.scale_by_schedule(fsg.optim.cosine(1.0, 1000))
    """
    if callable(schedule):
        _checks.schedule("scale_by_schedule(schedule=...)", schedule)
    else:
        checks.real("scale_by_schedule(schedule=...)", schedule, fix="Pass a float or a schedule")
    fn = as_schedule(schedule)

    def init(params):
        return ScaleByScheduleState(zeros_count(params))

    def update(updates, state, params=None):
        factor = fn(state.count)
        new_updates = tree.tree_map(lambda u: (factor * u).to(u.dtype), updates)
        return new_updates, ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


class ScaleByLearningRateState(NamedTuple):
    """State of ``scale_by_learning_rate``: the count, and the learning rate of the last update
    (float32, 0-d), which ``compile_step`` reports as the ``lr`` metric."""

    count: torch.Tensor
    learning_rate: torch.Tensor


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiplies updates by ``-learning_rate(count)`` (``+`` with ``flip_sign=False``).

    Args:
      learning_rate: a float, or a schedule (a function of the count tensor).
      flip_sign: descend (the default) rather than ascend.

    Example:
      >>> opt = fsg.optim.scale_by_learning_rate(fsg.optim.warmup_cosine(1e-3, warmup=10, total=100))
    """
    _checks.learning_rate("scale_by_learning_rate(learning_rate=...)", learning_rate)
    checks.flag("scale_by_learning_rate(flip_sign=...)", flip_sign)
    fn = as_schedule(learning_rate)
    sign = -1.0 if flip_sign else 1.0

    def init(params):
        count = zeros_count(params)
        return ScaleByLearningRateState(count, fn(count).to(torch.float32))

    def update(updates, state, params=None):
        value = fn(state.count)
        lr = step_lr = value.to(torch.float32)  # the metric's
        if scalar_dtype(updates) == torch.float64:  # a constant exact in float64; a schedule its float32 value
            constant = not callable(learning_rate)
            step_lr = lr.new_tensor(float(learning_rate), dtype=torch.float64) if constant else value.to(torch.float64)
        new_updates = tree.tree_map(lambda u: (sign * step_lr * u).to(u.dtype), updates)
        return new_updates, ScaleByLearningRateState(state.count + 1, lr)

    return GradientTransformation(init, update)


def learning_rate(opt_state: Any) -> torch.Tensor | None:
    """The learning rate of the last update, found in ``opt_state``; ``None`` if the optimizer
    has no ``scale_by_learning_rate`` part.

    Example:
      >>> opt = fsg.optim.sgd(0.1)
      >>> fsg.optim.learning_rate(opt.init({"w": torch.ones(2)}))
      tensor(0.1000)
    """
    if isinstance(opt_state, ScaleByLearningRateState):
        return opt_state.learning_rate
    if isinstance(opt_state, (tuple, list)):
        children = opt_state
    elif isinstance(opt_state, dict):
        children = opt_state.values()
    else:
        return None
    for child in children:
        found = learning_rate(child)
        if found is not None:
            return found
    return None
