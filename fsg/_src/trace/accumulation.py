"""Gradient accumulation's mean over microbatches, equal or weighted.

A step with ``accum_steps = k`` traces k forward/backward passes and averages their losses,
aux metrics and gradients. With equal weights that is the full batch's loss when the loss is
a mean over the same number of items in each microbatch. A loss averaged over a varying
number of items (the tokens that are not ``ignore_index``, padding) weights microbatches, not
items: microbatch j's mean ``s_j / n_j`` counts as much as any other, so the result is not
the full batch's ``sum(s_j) / sum(n_j)``: Hugging Face's gradient-accumulation bug of 2024.
``compile_step(microbatch_weight=fn)`` gives each microbatch the weight ``fn(microbatch)``
(its item count ``n_j``): ``sum(n_j * s_j / n_j) / sum(n_j)`` is the full batch's mean, and so
are the gradients. The weights are traced like the loss: on a mesh they are global counts.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fsg._src.errors import ArgumentError
from fsg._src.precision import at_least_float32


class Mean:
    """Sums microbatches' losses, aux metrics and gradients, weighted by ``weigh(microbatch)``
    when given; ``result()`` divides by their count, or by the weights' sum."""

    def __init__(self, n_grads: int, weigh: Callable[[Any], torch.Tensor] | None):
        self._weigh = weigh
        self._count = 0
        self._total: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._aux: dict[str, torch.Tensor] = {}
        self._grads: list[torch.Tensor | None] = [None] * n_grads

    def add(self, microbatch: Any, loss: torch.Tensor, aux: dict[str, torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        self._count += 1
        w = None if self._weigh is None else weight(self._weigh, microbatch)
        if w is not None:
            self._total = w if self._total is None else self._total + w
        loss = loss.to(at_least_float32(loss.dtype))  # a float64 loss stays float64
        loss = loss if w is None else loss * w.to(loss.dtype)
        self._loss = loss if self._loss is None else self._loss + loss
        for k, v in aux.items():
            v = v if w is None else v * w.to(v.dtype)
            self._aux[k] = self._aux[k] + v if k in self._aux else v
        for i, g in enumerate(grads):
            if g is not None:
                g = g if w is None else g * w.to(g.dtype)
                self._grads[i] = g if self._grads[i] is None else self._grads[i] + g

    def result(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor | None]]:
        """``(loss, aux, gradients)``: the (weighted) means; a gradient no microbatch had is ``None``."""
        if self._total is None and self._count == 1:
            return self._loss, self._aux, self._grads
        def div(t: torch.Tensor) -> torch.Tensor:
            return t / self._count if self._total is None else t / self._total.to(t.dtype)

        return div(self._loss), {k: div(v) for k, v in self._aux.items()}, [None if g is None else div(g) for g in self._grads]


def weight(fn: Callable[[Any], Any], microbatch: Any) -> torch.Tensor:
    """``fn(microbatch)`` as a float32 0-d tensor, or an ``ArgumentError`` saying what it returned."""
    w = fn(microbatch)
    if not isinstance(w, torch.Tensor) or w.dim() != 0 or w.is_complex():
        got = f"a tensor of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else f"a Python {type(w).__name__} ({w!r:.20})"
        raise ArgumentError(
            f"compile_step(microbatch_weight=...) must return a 0-d tensor computed from the microbatch (its "
            f"count of items, e.g. (mb['labels'] != -100).sum()); it returned {got}. A Python number would be "
            f"frozen into the graph"
        )
    return w.float()
