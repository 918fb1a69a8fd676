"""Stage 3 pass on a per-rank graph: pack FSDP's parameter all-gathers and prefetch them.

Stage 2 gathers each parameter over the data axes where the loss reads it (rule 3). With mixed
precision the loss casts every parameter first, so each gather, with its wait right after it,
sits at the step's start: one collective per parameter, one after the other, before the first
matmul. ``bucket_parameter_gathers`` orders the gathers by their first use in the step, packs
consecutive ones of one dtype and process group into buckets of at most ``bucket_mb``
gathered (each rank's shards concatenated; the ``[W, sum of shards]`` result split by columns),
issues bucket 0 at the step's start and bucket k+1 right before bucket k's wait (one bucket of
prefetch, as FSDP2 does), and waits for each bucket right before its first use. A gathered
parameter is the same node in the forward and the backward, so it is gathered once per step.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import moves
from fsg._src.passes.buckets import DEFAULT_BUCKET_MB

_aten = torch.ops.aten


def _placeholder_chain(node: fx.Node) -> list[fx.Node] | None:
    """The views and casts from a graph input to ``node`` (in order, ``node`` last), or
    ``None`` if ``node`` is not such a chain (an all-gather's input: a parameter's shard cast
    to the compute dtype)."""
    chain = []
    while node.op == "call_function" and node.target in moves.MOVABLE and len(node.all_input_nodes) == 1:
        chain.append(node)
        node = node.args[0]
    return list(reversed(chain)) if node.op == "placeholder" and chain else None


class _Gather:
    def __init__(self, collective: fx.Node, wait: fx.Node, chain: list[fx.Node], order: dict):
        self.collective, self.wait, self.chain = collective, wait, chain
        self.input, self.output = moves.meta_value(collective.args[0]), moves.meta_value(wait)
        self.first_use = min((u for u in wait.users), key=order.__getitem__)
        self.key = (self.input.dtype, self.input.device, *collective.args[1:])

    @property
    def nbytes(self) -> int:
        return self.output.numel() * self.output.element_size()


def _gathers(graph: fx.Graph) -> list[_Gather]:
    for node in graph.nodes:
        if node.target is _torch_private.ALL_GATHER:
            for wait in [u for u in node.users if u.target is _torch_private.WAIT_TENSOR]:
                moves.sink_casts(wait)  # the gathered weight's views move down to the matmul
    order = {n: k for k, n in enumerate(graph.nodes)}
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _torch_private.ALL_GATHER:
            continue
        users = list(node.users)
        chain = _placeholder_chain(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if len(users) != 1 or users[0].target is not _torch_private.WAIT_TENSOR or not users[0].users:
            continue
        if chain is None or moves.meta_value(node.args[0]) is None or moves.meta_value(users[0]) is None:
            continue
        found.append(_Gather(node, users[0], chain, order))
    return sorted(found, key=lambda g: order[g.first_use])


def _rewrite_gathers(graph: fx.Graph, bucket: list[_Gather], after: fx.Node) -> fx.Node:
    """Packs ``bucket``'s all-gathers into one, issued right after ``after``; returns the node
    right before the bucket's wait (placed before its first use), where the next bucket is
    issued. Rank r's shards are concatenated, so the gathered buffer is ``[W, sum of shard
    sizes]``: row r holds rank r's shards, and each parameter is its column block, made
    contiguous."""
    _, world, group = bucket[0].collective.args
    placed = set()  # the nodes up to the insertion point, as it moves
    for node in graph.nodes:
        placed.add(node)
        if node is after:
            break
    anchor = after
    for gather in bucket:  # the shard's cast (and views) move up to the collective if later,
        for node in gather.chain:  # never down (another reader may come before the collective)
            if node not in placed:
                anchor.append(node)
                anchor = node
                placed.add(node)
    sizes = [g.input.numel() for g in bucket]
    dtype = bucket[0].input.dtype
    with graph.inserting_before(anchor.next):
        flats = [graph.call_function(_aten.reshape.default, (g.collective.args[0], [-1])) for g in bucket]
        flat = graph.call_function(_aten.cat.default, (flats,))
        flat.meta["val"] = torch.empty(sum(sizes), dtype=dtype, device="meta")
        gathered = graph.call_function(_torch_private.ALL_GATHER, (flat, world, group))
        gathered.meta["val"] = torch.empty(world * sum(sizes), dtype=dtype, device="meta")
    with graph.inserting_before(bucket[0].first_use):
        done = graph.call_function(_torch_private.WAIT_TENSOR, (gathered,))
        done.meta["val"] = gathered.meta["val"]
        rows = graph.call_function(_aten.view.default, (done, [world, sum(sizes)]))
        pieces = graph.call_function(_aten.split_with_sizes.default, (rows, sizes, 1))
        for k, gather in enumerate(bucket):
            piece = graph.call_function(operator.getitem, (pieces, k))
            dense = graph.call_function(_aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})
            shaped = graph.call_function(_aten.view.default, (dense, list(gather.output.shape)))
            shaped.meta["val"] = gather.output
            gather.wait.replace_all_uses_with(shaped)
    for gather in bucket:
        graph.erase_node(gather.wait)
        graph.erase_node(gather.collective)
    return done.prev


def bucket_parameter_gathers(gm: fx.GraphModule, bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Packs the parameter all-gathers of ``gm`` (FSDP's, stage 2 rule 3) into buckets of at
    most ``bucket_mb`` gathered, in the order the step first uses them; bucket 0 is issued at
    the step's start and bucket k+1 right before bucket k's wait (one bucket of prefetch, as
    FSDP2 does). Gathers whose input is not a cast or view of a graph input (an uneven shard's
    padding) are left as they are. Returns the number of packed collectives."""
    items = _gathers(gm.graph)
    buckets: list[list[_Gather]] = []
    for item in items:
        current = buckets[-1] if buckets else None
        if current and current[0].key == item.key and sum(g.nbytes for g in current) + item.nbytes <= bucket_mb * 2**20:
            current.append(item)
        else:
            buckets.append([item])
    after = moves.last_placeholder(gm.graph)
    for bucket in buckets:
        after = _rewrite_gathers(gm.graph, bucket, after)
    gm.graph.lint()
    gm.recompile()
    return len(buckets)
