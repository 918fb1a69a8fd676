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

A bucket never holds an all-reduce whose input depends on an earlier member's result (tensor
parallel's forward all-reduces do): it is closed before such a member, so the rewrite keeps
every dependency. The sums are elementwise, so the result is the same as one collective per
tensor.

The forward's small collectives stop blocking the step too: one whose input depends on the
batch alone (the token count of a mean loss) is issued at the step's start, and a wait whose
result only feeds the step's outputs (the loss metric) moves to the step's end
(``defer_small_collectives``). FSDP's parameter all-gathers are packed by ``prefetch.py``,
which shares the view and cast moves of ``moves.py``.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes.moves import hoist_views, meta_value, sink_casts

log = logging.getLogger("fsg")

DEFAULT_BUCKET_MB = 25.0
_COLLECTIVES = (_torch_private.ALL_REDUCE, _torch_private.REDUCE_SCATTER)


class _Item:
    def __init__(self, collective: fx.Node, wait: fx.Node, order: dict):
        self.collective, self.wait = collective, wait
        self.input = collective.args[0]
        self.value = meta_value(self.input)
        self.ready = order[self.input]
        self.first_use = min(order[u] for u in wait.users) if wait.users else len(order)
        # what may share a bucket: the same collective, dtype, reduce op and process group
        self.key = (collective.target, self.value.dtype, self.value.device, *collective.args[1:])

    @property
    def nbytes(self) -> int:
        return self.value.numel() * self.value.element_size()


def _items(graph: fx.Graph, order: dict) -> list[_Item]:
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _COLLECTIVES:
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target is not _torch_private.WAIT_TENSOR or meta_value(node.args[0]) is None:
            continue
        found.append(_Item(node, users[0], order))
    return sorted(found, key=lambda item: item.ready)


def _buckets(items: list[_Item], bucket_bytes: int) -> list[list[_Item]]:
    buckets: list[list[_Item]] = []
    for item in items:
        current = buckets[-1] if buckets else None
        fits = (
            current is not None
            and current[0].key == item.key
            and sum(i.nbytes for i in current) + item.nbytes <= bucket_bytes
            # every result of the bucket is used only after this member's input exists (so
            # the input cannot depend on a result; a result itself is not a "use")
            and min(i.first_use for i in current) > item.ready
            and item.input not in {i.wait for i in current}
        )
        if fits:
            current.append(item)
        else:
            buckets.append([item])
    return buckets


def _rewrite(graph: fx.Graph, bucket: list[_Item], nodes: list[fx.Node]) -> None:
    order = {n: k for k, n in enumerate(nodes)}
    for item in bucket:  # an earlier rewrite may have replaced an input (a reduced result)
        item.input = item.collective.args[0]
    last_input = max((i.input for i in bucket), key=order.__getitem__)
    first_use = min((u for i in bucket for u in i.wait.users), key=order.__getitem__, default=None)
    if len(bucket) == 1:  # nothing to pack: issue it early, wait late
        item = bucket[0]
        item.input.append(item.collective)
        if first_use is not None:
            first_use.prepend(item.wait)
        return
    if bucket[0].collective.target is _torch_private.REDUCE_SCATTER:
        _rewrite_reduce_scatter(graph, bucket, last_input, first_use)
        return
    _, reduce_op, group = bucket[0].collective.args
    dtype = bucket[0].value.dtype
    sizes = [i.value.numel() for i in bucket]
    with graph.inserting_before(last_input.next):  # in creation order, right after the last input
        flats = [graph.call_function(torch.ops.aten.reshape.default, (i.input, [-1])) for i in bucket]
        flat = graph.call_function(torch.ops.aten.cat.default, (flats,))
        flat.meta["val"] = torch.empty(sum(sizes), dtype=dtype, device="meta")
        reduced = graph.call_function(_torch_private.ALL_REDUCE, (flat, reduce_op, group))
    anchor = first_use if first_use is not None else bucket[-1].wait
    with graph.inserting_before(anchor):
        done = graph.call_function(_torch_private.WAIT_TENSOR, (reduced,))
        pieces = graph.call_function(torch.ops.aten.split_with_sizes.default, (done, sizes))
        for k, item in enumerate(bucket):
            piece = graph.call_function(operator.getitem, (pieces, k))
            shaped = graph.call_function(torch.ops.aten.view.default, (piece, list(item.value.shape)))
            shaped.meta["val"] = item.value
            item.wait.replace_all_uses_with(shaped)
    for item in bucket:
        graph.erase_node(item.wait)
        graph.erase_node(item.collective)


def _rewrite_reduce_scatter(graph: fx.Graph, bucket: list[_Item], last_input: fx.Node, first_use) -> None:
    """Packs reduce-scatters: each input seen as ``[W, n_i / W]`` (rank r's shard is row r),
    concatenated along dim 1, so that one reduce-scatter hands rank r the concatenation of
    its shards, which a split and a view per tensor take apart."""
    _, reduce_op, world, group = bucket[0].collective.args
    dtype = bucket[0].value.dtype
    sizes = [i.value.numel() // world for i in bucket]
    with graph.inserting_before(last_input.next):
        rows = [graph.call_function(torch.ops.aten.reshape.default, (i.input, [world, -1])) for i in bucket]
        packed = graph.call_function(torch.ops.aten.cat.default, (rows, 1))
        packed.meta["val"] = torch.empty(world, sum(sizes), dtype=dtype, device="meta")
        reduced = graph.call_function(_torch_private.REDUCE_SCATTER, (packed, reduce_op, world, group))
    anchor = first_use if first_use is not None else bucket[-1].wait
    with graph.inserting_before(anchor):
        done = graph.call_function(_torch_private.WAIT_TENSOR, (reduced,))
        flat = graph.call_function(torch.ops.aten.reshape.default, (done, [-1]))
        pieces = graph.call_function(torch.ops.aten.split_with_sizes.default, (flat, sizes))
        for k, item in enumerate(bucket):
            shape = [item.value.shape[0] // world, *item.value.shape[1:]]
            piece = graph.call_function(operator.getitem, (pieces, k))
            shaped = graph.call_function(torch.ops.aten.view.default, (piece, shape))
            shaped.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
            item.wait.replace_all_uses_with(shaped)
    for item in bucket:
        graph.erase_node(item.wait)
        graph.erase_node(item.collective)



def bucket_gradient_collectives(gm: fx.GraphModule, bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Rewrites ``gm`` in place as the module docstring says; returns the number of
    collectives left of those it handled (one per bucket)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _COLLECTIVES:
            hoist_views(node.args[0])
            for wait in [u for u in node.users if u.target is _torch_private.WAIT_TENSOR]:
                sink_casts(wait)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    items = _items(gm.graph, order)
    buckets = _buckets(items, int(bucket_mb * 2**20))
    for bucket in buckets:
        _rewrite(gm.graph, bucket, list(gm.graph.nodes))
    gm.graph.lint()
    gm.recompile()
    return len(buckets)
