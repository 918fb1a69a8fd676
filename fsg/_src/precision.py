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
      reduce: on a mesh, the dtype gradients are summed across ranks in (all-reduce,
        reduce-scatter); ``None`` (default) reduces them in the dtype they come in (``param``).
        ``torch.bfloat16`` halves the bytes the reductions move (as FSDP2's
        ``MixedPrecisionPolicy(reduce_dtype=...)`` or DDP's ``bf16_compress_hook``); each
        rank's sum is then rounded to bf16 once before the reduction and the result cast back,
        so the update differs from the float32 reduction by about bf16's precision (3 digits).

    Example:
      >>> policy = fsg.Policy(param=torch.float32, compute=torch.bfloat16)
      >>> policy.cast_compute({"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)})["x"].dtype
      torch.bfloat16
    """

    param: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32
    reduce: torch.dtype | None = None

    def cast_compute(self, tree_: Any) -> Any:
        """Floating-point leaves of ``tree_`` in the compute dtype; other leaves unchanged."""
        return tree.tree_map(lambda t: t.to(self.compute) if t.is_floating_point() else t, tree_)

    def cast_param(self, tree_: Any) -> Any:
        """Floating-point leaves of ``tree_`` in the param dtype; other leaves unchanged."""
        return tree.tree_map(lambda t: t.to(self.param) if t.is_floating_point() else t, tree_)


def check_policy(policy: Any) -> Policy:
    """``policy`` if it is a valid ``Policy``; a ``TypeError`` naming the field otherwise."""
    if not isinstance(policy, Policy):
        raise TypeError(f"precision must be an fsg.Policy, got {type(policy).__name__}")
    for name in ("param", "compute", "reduce"):
        dtype = getattr(policy, name)
        if dtype is None and name == "reduce":
            continue
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"fsg.Policy({name}=...) must be a floating-point torch.dtype, got {dtype!r}")
    return policy
