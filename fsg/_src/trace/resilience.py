"""The in-graph half of docs/resilience.md: skipping non-finite steps and float16 loss scaling.

Everything here is traced into the step: the decision to skip is a 0-d bool tensor, applied
with ``torch.where`` to every leaf the step would write, so nothing waits on the host. The
flag is computed from the loss and the global gradient norm, both replicated on a mesh (stage
2 reduces them over every rank before they are read), so every rank takes the same decision
and replicas never diverge. The reference is optax's ``apply_if_finite``; the loss scale
follows ``torch.amp.GradScaler``.
"""

from __future__ import annotations

from typing import Any

import torch

from fsg._src import tree
from fsg._src.errors import StructureMismatchError
from fsg._src.precision import DynamicLossScale
from fsg._src.train_state import LossScaleState, SkipState, TrainState


def initial_skips(device: torch.device) -> SkipState:
    """The counters of a run that has skipped nothing."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return SkipState(zero, zero.clone())


def initial_loss_scale(config: DynamicLossScale | None, device: torch.device) -> LossScaleState | tuple:
    """The loss scale state of ``config`` at step 0 (``()`` without loss scaling)."""
    if config is None:
        return ()
    scale = torch.tensor(float(config.initial), dtype=torch.float32, device=device)
    return LossScaleState(scale, torch.zeros((), dtype=torch.int64, device=device))


def check_state(state: TrainState, *, skip: bool, config: DynamicLossScale | None) -> None:
    """Raises ``StructureMismatchError`` if ``state`` lacks what the step keeps there."""
    if skip and not isinstance(state.skips, SkipState):
        raise StructureMismatchError(
            f"the step skips non-finite steps and counts them in state.skips, but state.skips is "
            f"{state.skips!r:.40}; build the state with step.init (or pass skip_nonfinite=False)"
        )
    if config is not None and not isinstance(state.loss_scale, LossScaleState):
        raise StructureMismatchError(
            f"the step's Policy scales the loss (float16 compute), but state.loss_scale is "
            f"{state.loss_scale!r:.40}; build the state with step.init of this step, or restore a "
            f"checkpoint with like= such a state"
        )


def scale_of(state: TrainState, config: DynamicLossScale | None) -> torch.Tensor | None:
    """The scale this step multiplies the loss by, ``None`` without loss scaling."""
    return None if config is None else state.loss_scale.scale


def is_finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: the loss and every gradient are finite. The sum of the loss and the norm is
    not finite iff one of them is not (a NaN or an Inf anywhere in the gradients makes the
    norm one), and both are replicated on a mesh, so every rank computes the same flag."""
    return torch.isfinite(loss.float() + grad_norm.float())


def keep_if_skipped(finite: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` where the step is finite, ``old`` (every leaf) where it is skipped."""
    return tree.tree_map(lambda n, o: n if n is o else torch.where(finite, n, o), new, old)


def next_skips(finite: torch.Tensor, skips: SkipState) -> SkipState:
    """The counters after a step whose flag is ``finite``."""
    missed = torch.logical_not(finite).to(torch.int64)
    return SkipState(skips.skipped + missed, (skips.consecutive + 1) * missed)


def next_loss_scale(finite: torch.Tensor, state: LossScaleState, config: DynamicLossScale) -> LossScaleState:
    """Halve (``backoff``, not below ``min_scale``) on a non-finite step; grow after
    ``growth_interval`` finite steps in a row, restarting the count."""
    good = state.good_steps + 1
    grow = good >= config.growth_interval
    shrunk = torch.clamp(state.scale * config.backoff, min=config.min_scale)
    scale = torch.where(finite, torch.where(grow, state.scale * config.growth, state.scale), shrunk)
    good = torch.where(torch.logical_and(finite, torch.logical_not(grow)), good, torch.zeros_like(good))
    return LossScaleState(scale, good)
