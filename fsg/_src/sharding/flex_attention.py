"""FlexAttention on a mesh: a batch-sharded call stays local.

DTensor has no rule for the ``flex_attention`` and ``flex_attention_backward`` operators, so by
rule 4 they run on gathered inputs (every rank the whole attention: correct, and what data
parallelism was meant to save). Where the batch alone is sharded, each rank's attention is its
own sequences' attention, and this module runs it on the local shards instead, when all of
this holds, so that the result is the global op's:

- query, key, value (and, for the backward, the output, its log-sum-exp and their gradients)
  have one placement, each mesh dim ``Shard(0)`` or ``Replicate()``, at least one sharded;
- the block mask's tensors are replicated and have batch size 1 (one mask for every sequence);
- the captured tensors of the score and mask functions are replicated;
- neither function reads its batch index ``b`` (a local index would name another sequence).

The forward's results take the inputs' placement; the backward's query, key and value
gradients too, and the gradient of each captured tensor is ``Partial`` (a sum of the ranks'
sequences) over the sharded mesh dims. Anything else returns ``None``: rule 4 applies.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsg._src import _torch_private, tree

FORWARD, BACKWARD = "flex_attention", "flex_attention_backward"
# (number of leading batch tensors, index of the score function(s), of the block mask, of the captured tensors)
_LAYOUT = {FORWARD: (3, (3,), 4, 7), BACKWARD: (7, (7, 8), 9, 12)}


def is_flex(target: Any) -> bool:
    return isinstance(target, _torch_private.HigherOrderOperator) and target.name() in _LAYOUT


def batch_local(target: Any, args: tuple, kwargs: dict, device_mesh: Any) -> Any:
    """``target(*args)`` run on each rank's sequences, its results placed as the module says;
    ``None`` where that would not be the global op."""
    if not is_flex(target) or kwargs:
        return None
    n_batch, score_at, mask_at, buffers_at = _LAYOUT[target.name()]
    batch = [a for a in args[:n_batch] if a is not None]
    placements = _batch_placements(batch)
    if placements is None:
        return None
    block_mask = args[mask_at]
    mask_tensors = [t for t in block_mask if isinstance(t, torch.Tensor)]
    captured = [t for group in args[buffers_at:] for t in group if isinstance(t, torch.Tensor)]
    if not all(t.shape[0] == 1 for t in mask_tensors) or not all(_replicated(t) for t in mask_tensors + captured):
        return None
    if any(_reads_batch_index(args[i], 1) for i in score_at) or _reads_batch_index(block_mask[-1], 0):
        return None
    out = target(*tree.tree_map(_local, args))
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    summed = tuple(Partial() if i in sharded else Replicate() for i in range(device_mesh.ndim))

    def place(t: Any, how: tuple) -> Any:
        return DTensor.from_local(t, device_mesh, how, run_check=False) if isinstance(t, torch.Tensor) else t

    if target.name() == FORWARD:
        return tuple(place(t, placements) for t in out)
    *grads, captured_grads = out
    return (*(place(t, placements) for t in grads), tuple(place(t, summed) for t in captured_grads))


def _batch_placements(tensors: list) -> tuple | None:
    """The one placement of ``tensors`` if every one is a DTensor sharded on the batch dim alone
    (each mesh dim ``Shard(0)`` or ``Replicate()``, one at least ``Shard(0)``); else ``None``."""
    if not tensors or not all(isinstance(t, DTensor) for t in tensors):
        return None
    placements = tuple(tensors[0].placements)
    if any(tuple(t.placements) != placements or t.shape[0] != tensors[0].shape[0] for t in tensors):
        return None
    if not all(p == Shard(0) or isinstance(p, Replicate) for p in placements) or Shard(0) not in placements:
        return None
    return placements


def _replicated(t: torch.Tensor) -> bool:
    return not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements)


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _reads_batch_index(fn: Any, at: int) -> bool:
    """Whether the score or mask function ``fn`` (a traced graph) reads its argument ``at``, the
    batch index; ``True`` where that cannot be told."""
    if not isinstance(fn, fx.GraphModule):
        return True
    placeholders = list(fn.graph.find_nodes(op="placeholder"))
    return len(placeholders) <= at or bool(placeholders[at].users)
