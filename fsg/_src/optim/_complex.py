"""Complex parameters, optimized as ``torch.optim`` optimizes them: as pairs of real numbers.

An optimizer's math is written for real tensors: Adam's second moment is ``g * g`` and a
global norm sums ``g ** 2``, which on a complex gradient are complex squares, not ``|g|^2``.
``torch.optim`` views each complex parameter, its gradient and its state as real
(``torch.view_as_real``: a trailing dimension of 2, real and imaginary parts), and so does a
compiled step, at the optimizer's boundary: ``init`` and ``update`` see the real views, and
the updates come back complex. The gradient itself is torch's: the conjugate Wirtinger
derivative, whose real view is ``(dL/d re, dL/d im)``.

Example:
  >>> params = {"w": torch.tensor([1 + 2j, 3 - 1j])}
  >>> real_views(params)["w"]
  tensor([[ 1.,  2.],
          [ 3., -1.]])
  >>> complex_like({"w": torch.ones(2, 2)}, params)["w"]
  tensor([1.+1.j, 1.+1.j])
"""

from __future__ import annotations

from typing import Any

import torch

from fsg._src import _torch_private, tree
from fsg._src.errors import ArgumentError


def real_views(tree_: Any) -> Any:
    """``tree_`` with each complex tensor viewed as real (``torch.view_as_real``)."""
    return tree.tree_map(lambda t: torch.view_as_real(t) if t.is_complex() else t, tree_)


def complex_like(updates: Any, params: Any) -> Any:
    """``updates`` (real views where ``params`` are complex) viewed back as complex."""
    return tree.tree_map(lambda u, p: torch.view_as_complex(u.contiguous()) if p.is_complex() else u, updates, params)


def check_real(optimizer: str, params: Any) -> None:
    """Raises ``ArgumentError`` if a leaf of ``params`` is the real view of a complex
    parameter: for optimizers whose math has no meaning on one (factored or orthogonalized
    matrices mix the real and imaginary parts), as ``torch.optim`` refuses them too."""
    for path, p in zip(tree.leaf_paths(params, "params"), tree.flatten(params)[0]):
        if _torch_private.view_base(p).is_complex():
            raise ArgumentError(
                f"{optimizer}: {path} is complex, and {optimizer} does not support complex parameters (nor does "
                f"torch.optim's). Train it with adamw, adam, sgd, rmsprop or adagrad in a group of its own: "
                f"fsg.optim.multi_transform({{...}}, labels) (docs/optimizers.md#complex-parameters)"
            )
