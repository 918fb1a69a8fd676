"""The host-side half of docs/resilience.md: give up after too many skipped steps in a row.

The step skips non-finite steps in the graph and counts them in ``state.skips``
(``trace/resilience.py``); reading that count is a host sync, so ``Watchdog`` reads it only
every ``check_every`` steps, never at the others.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from fsg._src import checks
from fsg._src.errors import NonFiniteError
from fsg._src.train_state import LossScaleState, SkipState


class SkipNonFinite(NamedTuple):
    """How a step treats a non-finite loss or gradient: ``compile_step(skip_nonfinite=...)``.

    Such a step leaves params, optimizer state and buffers unchanged (inside the graph, no
    host sync) and counts itself in ``state.skips`` and ``metrics["skipped"]``. Every
    ``check_every`` calls the step reads ``state.skips.consecutive`` on the host (one sync)
    and raises ``fsg.NonFiniteError`` if it has reached ``max_consecutive``.

    Attributes:
      max_consecutive: skips in a row that end the run; ``None`` never ends it.
      check_every: calls between two checks (the only host syncs this costs).

    Example:
      >>> loss_fn = lambda params, batch: (params["w"] * batch).sum()
      >>> policy = SkipNonFinite(max_consecutive=20, check_every=10)  # fsg.SkipNonFinite
      >>> step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), skip_nonfinite=policy, backend="eager")
      >>> state, metrics = step(step.init({"w": torch.ones(2)}), torch.tensor([1.0, float("nan")]))
      >>> int(metrics["skipped"]), state.params["w"].tolist()
      (1, [1.0, 1.0])
    """

    max_consecutive: int | None = 100
    check_every: int = 100


def resolve(option: Any) -> tuple[bool | None, SkipNonFinite]:
    """``compile_step(skip_nonfinite=...)`` as (on: True, False or None for the default, the
    policy); raises ``ArgumentError`` for anything but a bool, ``None`` or a ``SkipNonFinite``."""
    if option is None or isinstance(option, bool):
        return option, SkipNonFinite()
    checks.instance("compile_step(skip_nonfinite=...)", option, SkipNonFinite,
                    what="True, False, None or an fsg.SkipNonFinite", fix="E.g. fsg.SkipNonFinite(max_consecutive=50)")  # fmt: skip
    if option.max_consecutive is not None:
        checks.integer("SkipNonFinite(max_consecutive=...)", option.max_consecutive, low=1, fix="Or None: never raise")
    checks.integer("SkipNonFinite(check_every=...)", option.check_every, low=1, fix="E.g. 100")
    return True, option


def _value(t: torch.Tensor) -> float:
    return (t.to_local() if isinstance(t, DTensor) else t).item()


class Watchdog:
    """Counts calls; every ``check_every`` of them reads the state's consecutive skips."""

    def __init__(self, policy: SkipNonFinite):
        self._policy = policy
        self._calls = 0

    def after_step(self, state: Any) -> None:
        """Raises ``NonFiniteError`` naming the skipped steps when there are too many in a row."""
        self._calls += 1
        limit = self._policy.max_consecutive
        if limit is None or self._calls % self._policy.check_every or not isinstance(state.skips, SkipState):
            return
        consecutive = int(_value(state.skips.consecutive))
        if consecutive < limit:
            return
        step = int(_value(state.step))
        scale = ""
        if isinstance(state.loss_scale, LossScaleState):
            scale = f" The float16 loss scale is down to {_value(state.loss_scale.scale):g}."
        raise NonFiniteError(
            f"steps {step - consecutive} to {step - 1} (state.step counts from 0) all had a non-finite loss or "
            f"gradient and were skipped: {consecutive} in a row, at least max_consecutive={limit}.{scale} "
            f"Look for the step where the loss first became NaN or Inf (metrics['skipped'] counts skips), lower the "
            f"learning rate or clip gradients, or restore an earlier checkpoint; "
            f"fsg.SkipNonFinite(max_consecutive=None) never stops the run."
        )
