"""Mixed precision: the dtype parameters are stored in and the dtype the loss computes in."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsg._src import checks, tree


class _PolicyFields(NamedTuple):
    param: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype | None


class Policy(_PolicyFields):
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

    __slots__ = ()

    def __new__(
        cls, param: torch.dtype = torch.float32, compute: torch.dtype = torch.float32, reduce: torch.dtype | None = None
    ) -> Policy:
        policy = super().__new__(cls, param, compute, reduce)
        check_policy(policy)
        return policy

    def cast_compute(self, tree_: Any) -> Any:
        """Floating-point leaves of ``tree_`` in the compute dtype; other leaves unchanged."""
        return tree.tree_map(lambda t: t.to(self.compute) if t.is_floating_point() else t, tree_)

    def cast_param(self, tree_: Any) -> Any:
        """Floating-point leaves of ``tree_`` in the param dtype; other leaves unchanged."""
        return tree.tree_map(lambda t: t.to(self.param) if t.is_floating_point() else t, tree_)


def check_policy(policy: Any) -> Policy:
    """``policy`` if it is a valid ``Policy``; an ``ArgumentError`` naming the field otherwise."""
    checks.instance("precision", policy, Policy, what="an fsg.Policy",
                    fix="E.g. precision=fsg.Policy(compute=torch.bfloat16)")  # fmt: skip
    for name in ("param", "compute", "reduce"):
        dtype = getattr(policy, name)
        if dtype is None and name == "reduce":
            continue
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise checks.fail(f"fsg.Policy({name}=...)", "must be a floating-point torch.dtype", dtype,
                              "E.g. torch.float32 or torch.bfloat16 (integer leaves keep their dtype anyway)")  # fmt: skip
    return policy
