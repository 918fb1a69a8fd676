"""Gradient clipping transformations."""

from __future__ import annotations

import torch

from fsg._src import checks, tree
from fsg._src.optim._base import EmptyState, GradientTransformation, global_norm


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales all updates together so that their global L2 norm is at most ``max_norm``.

    The choice is made in the graph with ``torch.where`` (no host sync), as optax does:
    updates whose norm is below ``max_norm`` pass unchanged.

    Example:
      >>> clip = fsg.optim.clip_by_global_norm(1.0)
      >>> u, _ = clip.update({"g": torch.tensor([3.0, 4.0])}, clip.init(None))
      >>> u["g"]
      tensor([0.6000, 0.8000])
    """
    checks.real("clip_by_global_norm(max_norm=...)", max_norm, low=0.0, low_open=True, fix="Pass a norm such as 1.0")

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        norm = global_norm(updates)
        factor = torch.where(norm < max_norm, torch.ones_like(norm), max_norm / norm)
        return tree.tree_map(lambda u: (u * factor).to(u.dtype), updates), state

    return GradientTransformation(init, update)
