"""The op set a sharded step is built from: what stage 1 decomposes, what stage 2 trusts.

DTensor derives a sharding strategy for an op without a registered rule by running the op's
decomposition on a size-1 mesh and then running the *whole* op on each rank's shard. For an
op whose decomposition divides by a size (``mse_loss``'s mean, its backward's ``2 / numel``,
``native_group_norm_backward``'s ``1 / N``) the local op then divides by the local size:
the sharded step's gradients were silently wrong (issue 14: 5e-3 to 4e-2 off for
``F.mse_loss``, ``F.huber_loss``, ``F.binary_cross_entropy``, a ``GroupNorm`` model...).

So on a mesh fsg never relies on that path:

1. Stage 1 traces with ``mesh_decompositions()``: the decomposition of every op that has no
   registered DTensor rule, and of the ``DISTRUSTED`` ops whose registered rule the op
   corpus caught computing something else. The decomposition runs on the *global* shapes,
   so every size it divides by is the global one.
2. Stage 2 runs an op on DTensors only if DTensor has a registered rule for it
   (``_torch_private.dtensor_has_rule``); anything else is a ``ShardingRuleError`` naming
   the op, the user's line and the placements it met.

Ops that have a rule stay whole. Decomposing them too (all of torch's core-ATen table, as
Inductor does) was tried and is worse: on torch 2.13 ``sum.default`` becomes
``sum.dim_IntList(x, [])``, which DTensor's rule reads as "no dim reduced" and leaves a 0-d
result marked ``Shard(0)``; on torch 2.11 view ops become ``prims`` ops, which have no rules.
The rules kept are exercised by the op corpus (``tests/dist/test_op_corpus.py``), and
``compile_step(..., verify=True)`` checks a user's own step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fsg._src import _torch_private

_aten = torch.ops.aten

# Ops DTensor has rules for that are decomposed all the same, because the op corpus saw the
# rule compute something else: with class weights or ignore_index and rows sharded, the
# nll_loss rules divide each rank's sum by its *local* total weight (F.cross_entropy(weight=)
# and F.nll_loss(ignore_index=) off by up to 20%). Decomposed, the weight sum is a partial
# sum, reduced before the division.
DISTRUSTED: frozenset = frozenset(
    {
        _aten.nll_loss_forward.default,
        _aten.nll_loss_backward.default,
        _aten.nll_loss2d_forward.default,
        _aten.nll_loss2d_backward.default,
    }
)


@functools.lru_cache(maxsize=1)
def mesh_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table stage 1 traces with on a mesh (see the module docstring)."""
    candidates = {**_torch_private.all_decompositions(), **_torch_private.core_decompositions()}
    return {
        op: fn
        for op, fn in candidates.items()
        if isinstance(op, _torch_private.OpOverload) and (op in DISTRUSTED or not _torch_private.dtensor_has_rule(op))
    }


# Scans along a dim: DTensor's rules run them on each shard of a dim sharded along the scan
# (the op corpus saw torch.cumsum over a tensor-parallel dim off by 30%). Stage 2 gathers the
# scanned dim first.
SCANS: frozenset = frozenset(
    {
        _aten.cumsum.default,
        _aten.cumprod.default,
        _aten.logcumsumexp.default,
        _aten.cummax.default,
        _aten.cummin.default,
    }
)


# Reductions over ``dim=[]``: aten reduces every dim, DTensor's rule reduces none (a 0-d
# result marked Shard(0), then a crash or worse). Stage 2 runs them as full reductions.
FULL_REDUCTIONS = {_aten.sum.dim_IntList: _aten.sum.default, _aten.mean.dim: _aten.mean.default}


def full_reduction(target: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict] | None:
    """``(op, args, kwargs)`` of the full reduction a ``dim=[]`` reduction means, else None."""
    if target not in FULL_REDUCTIONS or len(args) < 2 or args[1] not in ([], (), None):
        return None
    keepdim = bool(args[2]) if len(args) > 2 else kwargs.get("keepdim", False)
    if keepdim:
        return None  # keeps every dim at size 1: rare; DTensor's own rule handles the shape
    dtype = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
    return FULL_REDUCTIONS[target], (args[0],), dtype


def non_negative_stack_dim(target: Any, args: tuple) -> tuple:
    """``stack``'s args with a negative ``dim`` counted from the front. torch 2.11's rule for
    ``stack(dim=-1)`` of tensors sharded on dim 1 marks the result Shard(2), the new dim,
    instead of Shard(1) (the op corpus saw ``torch.stack([h, g], -1).flatten(1)`` off by 45%
    under tensor parallelism)."""
    if target is not _aten.stack.default or len(args) < 2 or args[1] >= 0:
        return args
    return (args[0], args[1] + args[0][0].dim() + 1, *args[2:])


def _placement_text(placement: Any) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return str(placement)


def placements_text(args: Any) -> str:
    """The global shape and placements of every DTensor among ``args``, for error messages:
    ``(16, 4) [Shard(0)]``."""
    from torch.distributed.tensor import DTensor

    from fsg._src import tree

    seen = []
    for leaf in tree.flatten(args)[0]:
        if isinstance(leaf, DTensor):
            placements = ", ".join(_placement_text(p) for p in leaf.placements)
            seen.append(f"{tuple(leaf.shape)} [{placements}]")
    return "; ".join(seen) or "no DTensor inputs"
