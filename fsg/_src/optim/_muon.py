"""Muon (Jordan et al., 2024): momentum, then the update orthogonalized by a Newton-Schulz
iteration. The same algorithm as ``torch.optim.Muon`` (torch >= 2.9), step for step: the
momentum an exponential average (``lerp``), Nesterov by default, five quintic iterations in
bfloat16, the learning rate adjusted to the matrix's shape.

Muon is for the hidden 2-D weight matrices; embeddings, the output head, norms and biases
train with AdamW, in another group of ``fsg.optim.multi_transform`` (docs/optimizers.md).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Replicate
from torch.utils.flop_counter import register_flop_formula

from fsg._src import _torch_private, checks, tree
from fsg._src.errors import ArgumentError
from fsg._src.optim import _checks
from fsg._src.optim._base import GradientTransformation, chain
from fsg._src.optim._complex import check_real
from fsg._src.optim._schedules import ScalarOrSchedule
from fsg._src.optim._transforms import add_decayed_weights, scale_by_learning_rate

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's and Keller Jordan's
_ADJUST = (None, "original", "match_rms_adamw")


class ScaleByMuonState(NamedTuple):
    """State of ``scale_by_muon``: the momentum buffer."""

    momentum_buffer: Any


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """The Newton-Schulz iteration of ``torch.optim.Muon`` (in bfloat16): approximately
    ``U V^T`` for ``g = U S V^T``, computed on the wide orientation of ``g``. One op,
    ``fsg::newton_schulz``, in a traced step (see ``_replicated``)."""
    a, b, c = coefficients
    return torch.ops.fsg.newton_schulz(g, float(a), float(b), float(c), int(steps), float(eps))


@torch.library.custom_op("fsg::newton_schulz", mutates_args=())
def _newton_schulz(g: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float) -> torch.Tensor:
    x = g.bfloat16()
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).contiguous()


@_newton_schulz.register_fake
def _(g: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float) -> torch.Tensor:
    return torch.empty(g.shape, dtype=torch.bfloat16, device=g.device)


@register_flop_formula(torch.ops.fsg.newton_schulz)
def _flops(g_shape: torch.Size, a: float, b: float, c: float, steps: int, eps: float, *args: Any, **kwargs: Any) -> int:
    """Each iteration on the wide ``m x n`` orientation (``m <= n``): the Gram matrix ``x x^T``,
    its square, and the product with ``x`` (``Lowered.cost()`` counts them)."""
    m, n = sorted(g_shape)
    return steps * (4 * m * m * n + 2 * m**3)


@_torch_private.register_sharding(torch.ops.fsg.newton_schulz.default)
def _replicated(g, a, b, c, steps, eps):
    """On a mesh, each rank orthogonalizes the whole matrix, the unsharded computation: on a
    sharded one, DTensor would sum the iteration's bfloat16 partial products across ranks in
    bfloat16 (less precise than one matmul's float32 accumulation, and more so with more
    ranks). The update is gathered, as distributed Muon implementations do, and each rank
    keeps its shard of the result."""
    return [([Replicate()], [Replicate(), None, None, None, None, None])]


def _lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def scale_by_muon(
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon's update direction: the momentum (Nesterov by default) orthogonalized, scaled by
    the shape's learning-rate ratio (``adjust_lr_fn``: ``"original"``, the default,
    ``sqrt(max(1, rows / cols))``; ``"match_rms_adamw"``, ``0.2 * sqrt(max(rows, cols))``).

    Raises:
      ArgumentError: at ``init``, a parameter that is not a 2-D matrix (named).

    Example:
      >>> opt = fsg.optim.chain(fsg.optim.scale_by_muon(), fsg.optim.scale_by_learning_rate(0.02))
    """
    _checks.beta("scale_by_muon(momentum=...)", momentum)
    checks.flag("scale_by_muon(nesterov=...)", nesterov)
    _checks.eps("scale_by_muon(eps=...)", eps)
    checks.integer("scale_by_muon(ns_steps=...)", ns_steps, low=1, fix="torch.optim.Muon's default is 5")
    if not (isinstance(ns_coefficients, tuple) and len(ns_coefficients) == 3):
        raise checks.fail("scale_by_muon(ns_coefficients=...)", "must be a tuple (a, b, c)", ns_coefficients,
                          f"The default is {NS_COEFFICIENTS}")  # fmt: skip
    if adjust_lr_fn not in _ADJUST:
        raise checks.fail("scale_by_muon(adjust_lr_fn=...)", f"must be one of {_ADJUST}", adjust_lr_fn)

    def init(params: Any) -> ScaleByMuonState:
        check_real("muon", params)
        for path, p in zip(tree.leaf_paths(params, "params"), tree.flatten(params)[0]):
            if p.dim() != 2:
                raise ArgumentError(
                    f"muon: {path} has shape {tuple(p.shape)}, but Muon orthogonalizes 2-D weight matrices only "
                    f"(as torch.optim.Muon). Train the others (embeddings, head, norms, biases) with AdamW in a "
                    f"group of their own: fsg.optim.multi_transform({{'muon': fsg.optim.muon(0.02), 'adamw': "
                    f"fsg.optim.adamw(3e-4)}}, labels) (docs/optimizers.md)"
                )
        return ScaleByMuonState(tree.tree_map(torch.zeros_like, params))

    def update(updates: Any, state: ScaleByMuonState, params: Any = None) -> tuple[Any, ScaleByMuonState]:
        buffers = tree.tree_map(lambda buf, g: torch.lerp(buf, g, 1 - momentum), state.momentum_buffer, updates)

        def direction(g: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            d = orthogonalize(torch.lerp(g, buf, momentum) if nesterov else buf, ns_coefficients, ns_steps, eps)
            return d.to(g.dtype) * _lr_ratio(adjust_lr_fn, g.shape)  # scaled in float32, as torch adds it

        return tree.tree_map(direction, updates, buffers), ScaleByMuonState(buffers)

    return GradientTransformation(init, update)


def muon(
    learning_rate: ScalarOrSchedule,
    *,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon with decoupled weight decay: matches ``torch.optim.Muon`` with the same arguments,
    ``p <- p - lr * (ratio * NS(momentum) + weight_decay * p)``. For 2-D matrices only: put
    the rest in an AdamW group (``multi_transform``).

    Example:
      >>> hidden = lambda p: {k: "muon" if v.ndim == 2 and "embed" not in k else "adamw" for k, v in p.items()}
      >>> opt = fsg.optim.multi_transform({"muon": fsg.optim.muon(0.02), "adamw": fsg.optim.adamw(3e-4)}, hidden)
    """
    _checks.learning_rate("muon(learning_rate=...)", learning_rate)
    _checks.non_negative("muon(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    return chain(
        scale_by_muon(momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients, ns_steps=ns_steps,
                      eps=eps, adjust_lr_fn=adjust_lr_fn),  # fmt: skip
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )
