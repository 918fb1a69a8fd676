"""FlexAttention on a mesh: a call sharded on batch or heads stays local.

DTensor has no rule for the ``flex_attention`` and ``flex_attention_backward`` operators, so by
rule 4 they run on gathered inputs (every rank the whole attention: correct, and what data or
tensor parallelism was meant to save). Where only the batch (dim 0) and the heads (dim 1) are
sharded, each rank's attention is its own sequences' and heads' attention, and this module runs
it on the local shards instead, when all of this holds, so that the result is the global op's:

- query, key, value (and, for the backward, the output, its log-sum-exp and their gradients)
  have one placement, each mesh dim ``Shard(0)``, ``Shard(1)`` or ``Replicate()``, at least one
  sharded; query, key and value have one batch size, and a sharded head count divides evenly
  (grouped-query heads then pair up on each rank as they do globally);
- the block mask's tensors and the captured tensors of the score and mask functions are
  replicated, and the mask has size 1 in each sharded dim (one mask for every sequence / head);
- neither function reads the index of a sharded dim (``b``, ``h``): a local index would name
  another sequence or head (an ALiBi slope per head keeps a head-sharded call replicated).

The forward's results take the inputs' placement; the backward's query, key and value
gradients too, and the gradient of each captured tensor is ``Partial`` (a sum over the ranks'
pieces) over the sharded mesh dims. Anything else returns ``None``: rule 4 applies.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsg._src import _torch_private, tree

FORWARD, BACKWARD = "flex_attention", "flex_attention_backward"
# (number of leading per-token tensors, index of the score function(s), of the block mask, of the captured tensors)
_LAYOUT = {FORWARD: (3, (3,), 4, 7), BACKWARD: (7, (7, 8), 9, 12)}


def is_flex(target: Any) -> bool:
    return isinstance(target, _torch_private.HigherOrderOperator) and target.name() in _LAYOUT


def run_local(target: Any, args: tuple, kwargs: dict, device_mesh: Any) -> Any:
    """``target(*args)`` run on each rank's sequences and heads, its results placed as the
    module says; ``None`` where that would not be the global op."""
    if not is_flex(target) or kwargs:
        return None
    n_inputs, score_at, mask_at, buffers_at = _LAYOUT[target.name()]
    placements = _local_placements([a for a in args[:n_inputs] if a is not None], device_mesh)
    if placements is None:
        return None
    dims = {p.dim for p in placements if isinstance(p, Shard)}  # 0 (batch), 1 (heads)
    block_mask = args[mask_at]
    mask_tensors = [t for t in block_mask if isinstance(t, torch.Tensor)]
    captured = [t for group in args[buffers_at:] for t in group if isinstance(t, torch.Tensor)]
    if not all(t.shape[d] == 1 for t in mask_tensors for d in dims) or not all(map(_replicated, mask_tensors + captured)):
        return None
    if any(_reads(args[i], 1 + d) for i in score_at for d in dims) or any(_reads(block_mask[-1], d) for d in dims):
        return None  # score functions take (score, b, h, ...), mask functions (b, h, ...)
    out = target(*tree.tree_map(_local, args))
    summed = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in placements)

    def place(t: Any, how: tuple) -> Any:
        return DTensor.from_local(t, device_mesh, how, run_check=False) if isinstance(t, torch.Tensor) else t

    if target.name() == FORWARD:
        return tuple(place(t, placements) for t in out)
    *grads, captured_grads = out
    return (*(place(t, placements) for t in grads), tuple(place(t, summed) for t in captured_grads))


def _local_placements(tensors: list, device_mesh: Any) -> tuple | None:
    """The one placement of ``tensors`` if every one is a DTensor sharded on batch or heads alone
    (each mesh dim ``Shard(0)``, ``Shard(1)`` or ``Replicate()``, one at least sharded), with one
    batch size and head counts that divide evenly; else ``None``."""
    if not tensors or not all(isinstance(t, DTensor) for t in tensors):
        return None
    placements = tuple(tensors[0].placements)
    if any(tuple(t.placements) != placements or t.shape[0] != tensors[0].shape[0] for t in tensors):
        return None
    if not all(p in (Shard(0), Shard(1)) or isinstance(p, Replicate) for p in placements):
        return None
    heads = [device_mesh.size(i) for i, p in enumerate(placements) if p == Shard(1)]
    if not any(isinstance(p, Shard) for p in placements) or any(t.shape[1] % math.prod(heads) for t in tensors):
        return None
    return placements


def _replicated(t: torch.Tensor) -> bool:
    return not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements)


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _reads(fn: Any, at: int) -> bool:
    """Whether the score or mask function ``fn`` (a traced graph) reads its argument ``at`` (an
    index); ``True`` where that cannot be told."""
    if not isinstance(fn, fx.GraphModule):
        return True
    placeholders = list(fn.graph.find_nodes(op="placeholder"))
    return len(placeholders) <= at or bool(placeholders[at].users)
