"""Adafactor (Shazeer & Stern, 2018) as ``torch.optim.Adafactor`` computes it (torch >= 2.5):
the second moment of a matrix kept as a row and a column factor (memory ``rows + cols``, not
``rows * cols``), the step size relative to the parameter's scale, the update clipped by its
RMS. Its data-dependent scalars (``torch.optim`` reads them with ``.item()``) stay tensors here,
computed in the graph.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsg._src import checks, tree
from fsg._src.optim import _checks
from fsg._src.optim._base import GradientTransformation, scalar_dtype, zeros_count
from fsg._src.optim._complex import check_real


class AdafactorState(NamedTuple):
    """State of ``adafactor``: the update count, and per parameter its factored second moment
    (``row`` ``[..., rows, 1]`` and ``col`` ``[..., 1, cols]`` for a matrix, else ``row`` of the
    parameter's shape and an empty ``col``)."""

    count: torch.Tensor
    row: Any
    col: Any


def adafactor(
    learning_rate: float = 1e-2,
    *,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adafactor: matches ``torch.optim.Adafactor`` with the same arguments.

    Args:
      learning_rate: the largest relative step (``rho_t = min(lr, 1 / sqrt(t))``).
      beta2_decay: the second moment's averaging weight at update ``t`` is ``t ** beta2_decay``.
      eps: ``(eps1, eps2)``: eps1 floors the variance estimate (``None``: the dtype's machine
        epsilon), eps2 the parameter scale.
      d: the clipping threshold of the update's RMS.
      weight_decay: decoupled, scaled by ``learning_rate``.

    Example:
      >>> opt = fsg.optim.adafactor(1e-2)
    """
    _checks.learning_rate("adafactor(learning_rate=...)", learning_rate)
    if callable(learning_rate):
        raise checks.fail("adafactor(learning_rate=...)", "must be a float (torch.optim.Adafactor's is)", learning_rate)
    checks.real("adafactor(beta2_decay=...)", beta2_decay, high=0.0, fix="torch's default is -0.8")
    if not (isinstance(eps, tuple) and len(eps) == 2):
        raise checks.fail("adafactor(eps=...)", "must be a pair (eps1 or None, eps2)", eps, "The default is (None, 1e-3)")
    checks.real("adafactor(d=...)", d, low=1.0, fix="The clipping threshold; torch requires >= 1, the default is 1.0")
    _checks.non_negative("adafactor(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    eps1, eps2 = eps

    def init(params: Any) -> AdafactorState:
        check_real("adafactor", params)

        def row(p: torch.Tensor) -> torch.Tensor:
            return p.new_zeros((*p.shape[:-1], 1)) if p.dim() > 1 else torch.zeros_like(p)

        def col(p: torch.Tensor) -> torch.Tensor:
            return p.new_zeros((*p.shape[:-2], 1, p.shape[-1])) if p.dim() > 1 else p.new_zeros(0)

        return AdafactorState(zeros_count(params), tree.tree_map(row, params), tree.tree_map(col, params))

    def update(updates: Any, state: AdafactorState, params: Any = None) -> tuple[Any, AdafactorState]:
        if params is None:
            raise ValueError("adafactor needs params: call update(updates, state, params)")
        t = (state.count + 1).to(scalar_dtype(updates))
        beta = t**beta2_decay  # the new moment's weight (torch's one_minus_beta2_t)
        rho = torch.clamp(t.rsqrt(), max=learning_rate)

        def one(g: torch.Tensor, p: torch.Tensor, r: torch.Tensor, c: torch.Tensor):
            floor = torch.finfo(p.dtype).eps if eps1 is None else eps1
            scale = torch.clamp(p.norm(2) / p.numel() ** 0.5, min=eps2) * rho
            if g.dim() > 1:
                r = torch.lerp(r, g.norm(dim=-1, keepdim=True).square() / g.shape[-1], beta.to(r.dtype))
                c = torch.lerp(c, g.norm(dim=-2, keepdim=True).square() / g.shape[-2], beta.to(c.dtype))
                variance = (r @ c) / r.mean(dim=-2, keepdim=True).clamp(min=floor)
            else:
                r = torch.lerp(r, g * g, beta.to(r.dtype))
                variance = r
            u = variance.clamp(min=floor * floor).rsqrt() * g
            denom = torch.clamp(u.norm(2) / (u.numel() ** 0.5 * d), min=1.0)
            return -learning_rate * weight_decay * p - (scale / denom) * u, r, c

        leaves, treedef = tree.flatten(updates)
        out = [one(*x) for x in zip(leaves, *(tree.flatten(t)[0] for t in (params, state.row, state.col)))]
        new_updates, rows, cols = (tree.unflatten(treedef, [o[i] for o in out]) for i in range(3))
        return new_updates, AdafactorState(state.count + 1, rows, cols)

    return GradientTransformation(init, update)
