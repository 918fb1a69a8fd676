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
Buckets are cut by ``bucketing.buckets`` and packed by ``packing.pack`` (shared with
``buckets.py``).
"""

from __future__ import annotations

from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import bucketing, moves, packing
from fsg._src.passes.bucketing import DEFAULT_BUCKET_MB
from fsg._src.passes.ordering import NodeOrder


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
        chain = _placeholder_chain(node.args[0]) if isinstance(node.args[0], fx.Node) else None
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
    FSDP2 does). Gathers whose input is not a cast or view of a graph input (an uneven shard's
    padding, or an FP8-cast shard of ``Float8(all_gather="fp8")``, issued at the step's start
    by the float8 pass) are left as they are. Returns the number of packed collectives."""
    order = NodeOrder(gm.graph)
    items = _gathers(gm.graph, order)
    buckets = bucketing.buckets(items, bucket_mb * 2**20, key=lambda g: g.key, nbytes=lambda g: g.nbytes)
    after = moves.last_placeholder(gm.graph)
    for bucket in buckets:
        after = _rewrite_gathers(gm.graph, bucket, after, order)
    gm.graph.lint()
    gm.recompile()
    return len(buckets)
