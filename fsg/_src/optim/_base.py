"""The optimizer protocol: a ``GradientTransformation`` is a NamedTuple of two pure functions.

As in optax, ``init(params) -> state`` and ``update(updates, state, params) -> (updates,
state)``. Every state is a NamedTuple of tensors, so it is a pytree that a compiled step can
carry and a checkpoint can save; nothing is hidden in Python objects.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple

import torch

from fsg._src import checks, tree

Params = Any
Updates = Any
OptState = Any


class AdamWSpec(NamedTuple):
    """What an ``fsg.optim.adam`` or ``adamw`` update computes, as data: ``compile_step`` may
    run exactly this update as one fused kernel instead of the traced math (stage 3,
    ``passes/fuse_adamw.py``)."""

    b1: float
    b2: float
    eps: float
    weight_decay: float
    mask: Any
    learning_rate: Any  # a float or a schedule
    decay_state: bool = True  # adamw's chain has add_decayed_weights (EmptyState) in the middle


class GradientTransformation(NamedTuple):
    """A pair of pure functions ``(init, update)`` that turns gradients into updates.

    Attributes:
      init: ``init(params) -> state``.
      update: ``update(updates, state, params=None) -> (new_updates, new_state)``.
      spec: what ``update`` computes, as data, when it is an update fsg can run as a fused
        kernel (an ``AdamWSpec``, set by ``adam`` and ``adamw``); ``None`` otherwise. A chain
        around such a transformation is traced as math.

    Example:
      >>> opt = fsg.optim.sgd(0.1)
      >>> params = {"w": torch.ones(3)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.ones(3)}, state, params)
      >>> fsg.optim.apply_updates(params, updates)["w"]
      tensor([0.9000, 0.9000, 0.9000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    spec: AdamWSpec | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Composes transformations: each ``update`` feeds the next.

    Args:
      *transforms: the transformations, applied left to right.

    Returns:
      A ``GradientTransformation`` whose state is the tuple of the parts' states.

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.clip_by_global_norm(1.0), fsg.optim.adam(1e-3))
    """

    for i, t in enumerate(transforms):
        check_transformation(f"chain(...): argument {i}", t)

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Updates, state: tuple, params: Params = None) -> tuple[Updates, tuple]:
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init, update)


def check_transformation(where: str, value: Any) -> None:
    """Raises ``ArgumentError`` unless ``value`` is a ``GradientTransformation``."""
    if isinstance(value, GradientTransformation):
        return
    fix = "Use fsg.optim.adamw(...), fsg.optim.sgd(...) or another fsg.optim builder"
    if isinstance(value, torch.optim.Optimizer) or isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
        from fsg._src.optim._from_torch import equivalent  # (it imports the builders, which import this module)

        same = equivalent(value)
        fix = f"{fix}; this one is {same}, or fsg.optim.from_torch(optimizer)" if same else fix
        fix = f"fsg optimizers are optax-style pure functions, not torch.optim classes. {fix}"
    raise checks.fail(where, "must be an fsg.optim.GradientTransformation", value, fix)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Returns ``params + updates`` leaf by leaf, keeping each parameter's dtype.

    Example:
      >>> fsg.optim.apply_updates({"w": torch.ones(2)}, {"w": torch.ones(2)})["w"]
      tensor([2., 2.])
    """
    return tree.tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)


def scalar_dtype(updates: Updates) -> torch.dtype:
    """The dtype an optimizer computes its scalars in (bias corrections, a constant learning
    rate, a global norm) for these leaves: float64 when one is float64, as torch.optim computes
    them in Python floats; else float32 (bf16 and float32 training: the same bits as before
    this rule). A complex128 parameter's real view is float64."""
    return torch.float64 if any(leaf.dtype == torch.float64 for leaf in tree.flatten(updates)[0]) else torch.float32


def global_norm(updates: Updates) -> torch.Tensor:
    """The L2 norm of all leaves of ``updates`` together, as a 0-d tensor: float32, or float64
    when a leaf is float64 (``scalar_dtype``).

    Example:
      >>> fsg.optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
      tensor(5.)
    """
    leaves, _ = tree.flatten(updates)
    split = _SPLIT.get()
    if split is not None:  # a pipeline rank's part of the updates: the norm over every rank's
        return split.norm(leaves)
    if not leaves:
        return torch.zeros(())
    dtype = scalar_dtype(updates)
    squares = [torch.sum(x * x) for x in (leaf.to(dtype) for leaf in leaves)]
    return torch.sqrt(torch.stack(squares).sum())


def device_of(params: Params) -> torch.device:
    """The device of the first leaf of ``params`` (CPU for an empty tree)."""
    leaves, _ = tree.flatten(params)
    return leaves[0].device if leaves else torch.device("cpu")


def zeros_count(params: Params) -> torch.Tensor:
    """A fresh int32 update counter on the parameters' device."""
    return torch.zeros((), dtype=torch.int32, device=device_of(params))


class LeafSplit(NamedTuple):
    """The updates one pipeline rank's optimizer sees are its part of the whole tree: ``norm``
    returns the norm of the whole tree from this rank's leaves (a reduction over the ranks).
    Set by ``split_leaves`` around an update the pipeline step runs; not a graph option (the
    pipeline runs the update eagerly, every rank the same code)."""

    norm: Callable[[list[torch.Tensor]], torch.Tensor]


_SPLIT: contextvars.ContextVar[LeafSplit | None] = contextvars.ContextVar("fsg_leaf_split", default=None)


@contextlib.contextmanager
def split_leaves(split: LeafSplit | None) -> Iterator[None]:
    """Within it, ``global_norm`` is ``split.norm`` (``None``: the plain norm)."""
    token = _SPLIT.set(split)
    try:
        yield
    finally:
        _SPLIT.reset(token)
