"""Mixed precision: the dtype parameters are stored in and the dtype the loss computes in."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsg._src import tree


class Policy(NamedTuple):
    """Which floating-point dtypes a step uses.

    Attributes:
      param: the dtype parameters and optimizer state are kept and updated in (default
        float32). ``step.init`` casts floating-point params to it.
      compute: the dtype the loss runs in (default float32). Floating-point parameters are
        cast to it where the loss reads them (before an FSDP all-gather, so gathers move the
        smaller dtype) and floating-point batch leaves on entry; gradients come back in the
        ``param`` dtype through the cast's backward.

    Example:
      >>> policy = fsg.Policy(param=torch.float32, compute=torch.bfloat16)
      >>> policy.cast_compute({"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)})["x"].dtype
      torch.bfloat16
    """

    param: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32

    def cast_compute(self, tree_: Any) -> Any:
        """Floating-point leaves of ``tree_`` in the compute dtype; other leaves unchanged."""
        return tree.tree_map(lambda t: t.to(self.compute) if t.is_floating_point() else t, tree_)

    def cast_param(self, tree_: Any) -> Any:
        """Floating-point leaves of ``tree_`` in the param dtype; other leaves unchanged."""
        return tree.tree_map(lambda t: t.to(self.param) if t.is_floating_point() else t, tree_)
