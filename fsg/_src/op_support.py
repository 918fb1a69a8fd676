"""The op set a sharded step is built from: what stage 1 decomposes, what stage 2 trusts.

DTensor derives a sharding strategy for an op without a registered rule by running the op's
decomposition on a size-1 mesh and then running the *whole* op on each rank's shard. For an
op whose decomposition divides by a size (``mse_loss``'s mean, its backward's ``2 / numel``,
``native_group_norm_backward``'s ``1 / N``) the local op then divides by the local size:
the sharded step's gradients were silently wrong (issue 14: 5e-3 to 4e-2 off for
``F.mse_loss``, ``F.huber_loss``, ``F.binary_cross_entropy``, a ``GroupNorm`` model...).

So on a mesh fsg never relies on that path:

1. Stage 1 traces with ``mesh_decompositions()``: torch's core-ATen decompositions (the
   table Inductor and ``torch.export`` use) plus the decomposition of every op that has no
   registered DTensor rule, except the ``KEEP`` ops below. The decomposition runs on the
   *global* shapes, so every size it divides by is the global one.
2. Stage 2 runs an op on DTensors only if DTensor has a registered rule for it
   (``_torch_private.dtensor_has_rule``); anything else is a ``ShardingRuleError`` naming
   the op, the user's line and the placements it met.

``KEEP`` lists the ops that stay whole because their registered rules are dedicated and
verified by fsg's op corpus (``tests/dist/test_op_corpus.py``): fused losses and backward
kernels whose decomposed form would shard worse (more collectives) or trace slower.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fsg._src import _torch_private

_aten = torch.ops.aten

# Ops with dedicated DTensor rules, kept whole on a mesh. Each is exercised by a case of the
# op corpus under data parallel and FSDP (and tensor parallel where it applies).
KEEP: frozenset = frozenset(
    {
        _aten._log_softmax_backward_data.default,
        _aten._softmax_backward_data.default,
        _aten.native_layer_norm_backward.default,
        _aten.embedding_dense_backward.default,
        # pointwise backward kernels: a rule like any pointwise op, one node instead of five
        _aten.gelu_backward.default,
        _aten.tanh_backward.default,
        _aten.sigmoid_backward.default,
        _aten.threshold_backward.default,
        _aten.silu_backward.default,
        # full reductions: their core decomposition is ``sum.dim_IntList(x, [])``, which
        # DTensor's rule reads as "no dim reduced" and leaves a 0-d result Shard(0)
        _aten.sum.default,
        _aten.mean.default,
    }
)


# Not kept, though DTensor has rules for them: ``nll_loss_forward``/``nll_loss_backward`` (and
# the 2d pair). With class weights or ignore_index and rows sharded, their rule divides each
# rank's sum by its *local* total weight (the op corpus saw F.cross_entropy(weight=...) and
# F.nll_loss(ignore_index=...) off by up to 20%); decomposed, the weight sum is a partial sum
# reduced before the division.

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


@functools.lru_cache(maxsize=1)
def mesh_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table stage 1 traces with on a mesh (see the module docstring)."""
    table = dict(_torch_private.core_decompositions())
    for op, fn in _torch_private.all_decompositions().items():
        if op not in table and isinstance(op, _torch_private.OpOverload) and not _torch_private.dtensor_has_rule(op):
            table[op] = fn
    for op in KEEP:
        table.pop(op, None)
    return table


def placements_text(args: Any) -> str:
    """The placements of every DTensor among ``args``, for error messages."""
    from torch.distributed.tensor import DTensor

    from fsg._src import tree

    seen = []
    for leaf in tree.flatten(args)[0]:
        if isinstance(leaf, DTensor):
            placements = ", ".join(str(p) for p in leaf.placements)
            seen.append(f"{tuple(leaf.shape)} [{placements}]")
    return "; ".join(seen) or "no DTensor inputs"
