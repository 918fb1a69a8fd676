"""Stage 3 pass on a bucketed per-rank graph: each bucket's params are updated as soon as its
gradient reduction lands (the fused AdamW node split per bucket)."""

from __future__ import annotations

import operator

from torch import fx

from fsg._src import _torch_private, tree
from fsg._src.passes.fuse_adamw import FUSED_ADAMW, through_views
from fsg._src.passes.ordering import NodeOrder


def _arrival(grad: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """The ``wait_tensor`` a gradient comes out of (through the bucket's split and views) and
    the nodes on the way, from the wait down; ``(None, [])`` if it is not a collective's result."""
    chain = [grad]
    node = grad
    while node.op == "call_function" and node.target is not _torch_private.WAIT_TENSOR:
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None, []
        node = inputs[0]
        chain.append(node)
    if node.op != "call_function":
        return None, []
    return node, chain[::-1]


def _sink_readers(node: fx.Node, chains: list[fx.Node], mutated: set[fx.Node], order: NodeOrder) -> bool:
    """Moves the pure readers of the reduced gradients that sit before the fused update
    ``node`` (a gradient-norm metric) to just after it, so that waits can move down to their
    own bucket's update. Refuses (returns False, moving nothing) if one of them mutates
    something or reads a tensor the update writes."""
    inside = set(chains)
    readers: dict[fx.Node, None] = {}
    frontier = list(chains)
    while frontier:
        for user in frontier.pop().users:
            if user is node or user in inside or user in readers or order.before(node, user):
                continue
            readers[user] = None
            frontier.append(user)
    for reader in readers:
        target = reader.target
        pure = reader.op == "call_function" and (target is operator.getitem or _torch_private.is_pure_op(target))
        args = [a for a in tree.flatten((reader.args, reader.kwargs))[0] if isinstance(a, fx.Node)]
        if not pure or any(through_views(a) in mutated for a in args):
            return False
    anchor = node.next
    for reader in order.sorted(readers):
        anchor.prepend(reader)
    order.invalidate()
    return True


def update_on_arrival(gm: fx.GraphModule) -> int:
    """Splits the one ``fsg::fused_adamw_`` node of a bucketed per-rank graph into one per
    bucket, in the order the buckets' collectives were issued, each right after its bucket's
    wait: the params of early buckets are updated while the last reductions (on NCCL, the
    embedding's, computed last in the backward) are still in flight, instead of after them.
    AdamW is elementwise per tensor, so the result is the same. Readers of the gradients that
    the update does not need (a gradient-norm metric) move after the updates. Returns the
    number of fused nodes after the split."""
    graph = gm.graph
    fused = [n for n in graph.nodes if n.op == "call_function" and n.target is FUSED_ADAMW]
    if len(fused) != 1:
        return len(fused)
    node = fused[0]
    params, grads, mus, nus, count, lr, b1, b2, eps, wds, *finite = node.args
    if finite and finite[0] is not None:
        # A step that skips non-finite steps updates only once every gradient's norm is
        # known: there is no earlier point to move updates to (docs/resilience.md).
        return 1
    groups: dict[fx.Node | None, list[int]] = {}
    chains: dict[fx.Node | None, dict[fx.Node, None]] = {}  # ordered sets
    for k, grad in enumerate(grads):
        wait, chain = _arrival(grad)
        groups.setdefault(wait, []).append(k)
        chains.setdefault(wait, {}).update(dict.fromkeys(chain))
    if len(groups) < 2:
        return 1
    all_chains = [n for chain in chains.values() for n in chain]
    order = NodeOrder(graph)
    sunk = _sink_readers(node, all_chains, {*params, *mus, *nus}, order)
    keys = sorted(groups, key=lambda w: -1 if w is None else order.position(w.args[0]))  # issue order
    for wait in keys:
        ks = groups[wait]
        moved = order.sorted(chains[wait])
        if sunk and all(order.before(node, u) or u in chains[wait] or u is node for n in moved for u in n.users):
            for n in moved:  # its wait and split just before its update, after the earlier updates
                node.prepend(n)
        with graph.inserting_before(node):
            graph.call_function(
                FUSED_ADAMW,
                (
                    [params[k] for k in ks],
                    [grads[k] for k in ks],
                    [mus[k] for k in ks],
                    [nus[k] for k in ks],
                    count,
                    lr,
                    b1,
                    b2,
                    eps,
                    [wds[k] for k in ks],
                ),
            )
        order.invalidate()  # moved the chain, inserted an update
    graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return len(keys)
