"""Stage 3 pass on a per-rank graph: pack FSDP's parameter all-gathers and prefetch them.

Stage 2 gathers each parameter over the data axes where the loss reads it (rule 3). With mixed
precision the loss casts every parameter first, so each gather, with its wait right after it,
sits at the step's start: one collective per parameter, one after the other, before the first
matmul. ``bucket_parameter_gathers`` orders the gathers by their first use in the step, packs
those of one dtype and process group, in that order, into buckets of at most ``bucket_mb``
gathered (each rank's shards concatenated; the ``[W, sum of shards]`` result split by columns),
issues bucket 0 at the step's start and bucket k+1 right before bucket k's wait (one bucket of
prefetch, as FSDP2 does), and waits for each bucket right before its first use. A gathered
parameter is the same node in the forward and the backward, so it is gathered once per step.
Buckets are cut by ``bucketing.buckets`` and packed by ``packing.pack`` (shared with
``buckets.py``).
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import bucketing, moves, packing
from fsg._src.passes.bucketing import DEFAULT_BUCKET_MB
from fsg._src.passes.ordering import NodeOrder

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


def _inputs(node: fx.Node, order: NodeOrder) -> list[fx.Node] | None:
    """What an all-gather's input is computed from, in graph order (``node`` last): a chain of
    views and casts from a graph input (a shard cast to the compute dtype), or, for a shard cast
    to FP8 and viewed as bytes (``Float8(all_gather="fp8")``), every op it is computed from,
    all from graph inputs (the shards' amaxes and their all-reduce among them); ``None`` for
    anything else (an uneven shard's padding)."""
    chain = _placeholder_chain(node)
    if chain is not None or node.target is not _aten.view.dtype:
        return chain
    seen, stack = {node}, [node]
    while stack:
        for n in stack.pop().all_input_nodes:
            if n.op == "call_function" and n.all_input_nodes and n not in seen:
                seen.add(n)
                stack.append(n)
            elif n.op != "placeholder" and n not in seen:
                return None  # (an op of no inputs, a constant: not a shard's cast)
    return sorted(seen, key=order.position)


class _Gather:
    def __init__(self, collective: fx.Node, wait: fx.Node, chain: list[fx.Node], order: NodeOrder):
        self.collective, self.wait, self.chain = collective, wait, chain
        self.output = moves.meta_value(wait)
        self.first_use = order.first(wait.users)
        self.key = bucketing.key(collective)

    @property
    def nbytes(self) -> int:
        return self.output.numel() * self.output.element_size()


def _gathers(graph: fx.Graph, order: NodeOrder) -> list[_Gather]:
    for node in graph.nodes:
        if node.target is _torch_private.ALL_GATHER:
            for wait in [u for u in node.users if u.target is _torch_private.WAIT_TENSOR]:
                moves.sink_casts(wait, order)  # the gathered weight's views move down to the matmul
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _torch_private.ALL_GATHER:
            continue
        wait = packing.sole_wait(node)
        chain = _inputs(node.args[0], order) if isinstance(node.args[0], fx.Node) else None
        if wait is None or not wait.users:
            continue
        if chain is None or moves.meta_value(node.args[0]) is None or moves.meta_value(wait) is None:
            continue
        found.append(_Gather(node, wait, chain, order))
    return sorted(found, key=lambda g: order.position(g.first_use))


def _rewrite_gathers(graph: fx.Graph, bucket: list[_Gather], after: fx.Node, order: NodeOrder) -> fx.Node:
    """Packs ``bucket``'s all-gathers into one (``packing.pack``), issued right after ``after``;
    returns the node right before the bucket's wait (placed before its first use), where the
    next bucket is issued. The shards' casts (and views) that come after ``after`` move up to
    right after it, in the bucket's order; never down (another reader may come before the
    collective)."""
    late = dict.fromkeys(node for gather in bucket for node in gather.chain if order.before(after, node))
    anchor = after
    for node in late:
        anchor.append(node)
        anchor = node
    pairs = [(g.collective, g.wait) for g in bucket]
    done = packing.pack(graph, pairs, issue_before=anchor.next, wait_before=bucket[0].first_use)
    order.invalidate()
    return done.prev


def bucket_parameter_gathers(gm: fx.GraphModule, bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Packs the parameter all-gathers of ``gm`` (FSDP's, stage 2 rule 3) into buckets of at
    most ``bucket_mb`` gathered, in the order the step first uses them; bucket 0 is issued at
    the step's start and bucket k+1 right before bucket k's wait (one bucket of prefetch, as
    FSDP2 does). Gathers of different dtypes (``Float8(all_gather="fp8")``'s bytes beside the
    compute dtype's biases and norms) fill buckets of their own, each run in first-use order,
    so one kind between two of another does not cut their bucket. Gathers whose input is not
    computed from graph inputs so (``_inputs``: an uneven shard's padding) are left as they
    are. Returns the number of packed collectives."""
    order = NodeOrder(gm.graph)
    by_key: dict[tuple, list[_Gather]] = {}
    for gather in _gathers(gm.graph, order):  # (in first-use order)
        by_key.setdefault(gather.key, []).append(gather)
    budget = bucket_mb * 2**20
    buckets = [b for run in by_key.values() for b in bucketing.buckets(run, budget, key=lambda g: g.key, nbytes=lambda g: g.nbytes)]
    buckets.sort(key=lambda b: order.position(b[0].first_use))
    after = moves.last_placeholder(gm.graph)
    for bucket in buckets:
        after = _rewrite_gathers(gm.graph, bucket, after, order)
    gm.graph.lint()
    gm.recompile()
    return len(buckets)
