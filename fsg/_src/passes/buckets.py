"""Stage 3 pass on a per-rank graph: bucket gradient collectives and issue them early.

Gradient all-reduces (data parallel) and reduce-scatters (FSDP) are handled alike; a bucket of
reduce-scatters lays each gradient out as ``[W, n / W]`` rows so that every rank still gets
exactly its shards.

Stage 2 emits one ``all_reduce`` per gradient where the gradient is marked, after the whole
backward, each followed at once by its ``wait_tensor``: nothing overlaps, and small tensors
pay a collective's latency each. This pass walks the all-reduces in the order their inputs
become ready (the backward computes the last layer's gradients first), packs consecutive ones
of one dtype, reduce op and process group into buckets of at most ``bucket_bytes``
(``cat`` -> one ``all_reduce`` -> ``split``), places each bucket's collective right after its
last input is computed, and its wait right before the first use of any result. Collectives
are asynchronous on NCCL, so a bucket reduces while the rest of the backward runs.

Buckets are cut by ``bucketing.buckets`` and packed by ``packing.pack`` (shared with
``prefetch.py``). Only sums are bucketed: an all-reduce of another op (tensorwise FP8's
amaxes, ``max``, one a tensor, its result read by the cast right after it) stays where stage
2 put it, so that the amaxes of the backward do not cut its gradients' buckets. A bucket
never holds an all-reduce whose input depends on an earlier member's result (tensor
parallel's forward all-reduces do): it is closed before such a member, so the rewrite keeps
every dependency. The sums are elementwise, so the result is the
same as one collective per tensor.

The forward's small collectives stop blocking the step too: one whose input depends on the
batch alone (the token count of a mean loss) is issued at the step's start, and a wait whose
result only feeds the step's outputs (the loss metric) moves to the step's end
(``defer_small_collectives``). FSDP's parameter all-gathers are packed by ``prefetch.py``,
which shares the view and cast moves of ``moves.py``.
"""

from __future__ import annotations

import logging

from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import bucketing, packing
from fsg._src.passes.bucketing import DEFAULT_BUCKET_MB as DEFAULT_BUCKET_MB
from fsg._src.passes.moves import hoist_views, meta_value, sink_casts
from fsg._src.passes.ordering import NodeOrder

log = logging.getLogger("fsg")

_COLLECTIVES = (_torch_private.ALL_REDUCE, _torch_private.REDUCE_SCATTER)
_SUMS = ("sum", "avg")  # the reduce ops this pass buckets


class _Item:
    def __init__(self, collective: fx.Node, wait: fx.Node, order: NodeOrder):
        self.collective, self.wait = collective, wait
        self.input = collective.args[0]
        self.value = meta_value(self.input)
        self.ready = order.position(self.input)
        self.first_use = min(order.position(u) for u in wait.users) if wait.users else len(order)
        self.key = bucketing.key(collective)

    @property
    def nbytes(self) -> int:
        return self.value.numel() * self.value.element_size()


def _items(graph: fx.Graph, order: NodeOrder) -> list[_Item]:
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _COLLECTIVES:
            continue
        wait = packing.sole_wait(node)
        if wait is None or meta_value(node.args[0]) is None:
            continue
        found.append(_Item(node, wait, order))
    return sorted(found, key=lambda item: item.ready)


def _independent(bucket: list[_Item], item: _Item) -> bool:
    """Whether every result of ``bucket`` is used only after ``item``'s input exists (so the
    input cannot depend on a result; a result itself is not a "use")."""
    return min(i.first_use for i in bucket) > item.ready and item.input not in {i.wait for i in bucket}


def _rewrite(graph: fx.Graph, bucket: list[_Item], order: NodeOrder) -> None:
    for item in bucket:  # an earlier rewrite may have replaced an input (a reduced result)
        item.input = item.collective.args[0]
    last_input = order.last(i.input for i in bucket)
    first_use = order.first(u for i in bucket for u in i.wait.users)
    if len(bucket) == 1:  # nothing to pack: issue it early, wait late
        item = bucket[0]
        item.input.append(item.collective)
        if first_use is not None:
            first_use.prepend(item.wait)
    else:  # in creation order, right after the last input; waited for before the first use
        pairs = [(i.collective, i.wait) for i in bucket]
        wait_before = first_use if first_use is not None else bucket[-1].wait
        packing.pack(graph, pairs, issue_before=last_input.next, wait_before=wait_before)
    order.invalidate()


def bucket_gradient_collectives(gm: fx.GraphModule, bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Rewrites ``gm`` in place as the module docstring says; returns the number of
    collectives left of those it handled (one per bucket)."""
    order = NodeOrder(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _COLLECTIVES:
            hoist_views(node.args[0], order)
            for wait in [u for u in node.users if u.target is _torch_private.WAIT_TENSOR]:
                sink_casts(wait, order)
    # only sums (the gradients', a mean loss's): a maximum (tensorwise FP8's amaxes, read at once
    # by the cast after it) stays where stage 2 put it, so it cannot cut a run of sums in two
    items = [item for item in _items(gm.graph, order) if item.collective.args[1] in _SUMS]
    buckets = bucketing.buckets(
        items, int(bucket_mb * 2**20), key=lambda i: i.key, nbytes=lambda i: i.nbytes, joins=_independent
    )
    for bucket in buckets:
        _rewrite(gm.graph, bucket, order)
    gm.graph.lint()
    gm.recompile()
    return len(buckets)
