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
which shares this module's view and cast moves.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import facts

log = logging.getLogger("fsg")

DEFAULT_BUCKET_MB = 25.0
_COLLECTIVES = (_torch_private.ALL_REDUCE, _torch_private.REDUCE_SCATTER)


_aten = torch.ops.aten
_VIEWS = frozenset(
    {_aten.t.default, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.permute.default,
     _aten.transpose.int, _aten.squeeze.dim, _aten.unsqueeze.default, _aten.alias.default, _aten.detach.default}
)  # fmt: skip
# views, plus the dtype cast: the pure single-input ops moved with a collective's input or result
MOVABLE = _VIEWS | {_aten._to_copy.default}


def _hoist_views(node: fx.Node) -> None:
    """Moves the chain of view ops and dtype casts that ends in ``node`` right after the op
    that produced its data: stage 2 emits those views where the gradient is marked, after the
    whole backward, which would pin the collective there too. The casts are mixed precision's:
    a float32 parameter is cast to bf16 before the forward, so autograd runs the backward of
    that cast (the bf16 gradient cast to float32) after the whole backward; left there, it
    made every bucket wait for the end of the backward."""
    chain = []
    while (
        node.op == "call_function"
        and node.target in MOVABLE
        and isinstance(node.args[0], fx.Node)
        and not any(isinstance(a, fx.Node) for a in node.args[1:])
        and not any(isinstance(a, fx.Node) for a in node.kwargs.values())
    ):
        chain.append(node)
        node = node.args[0]
    if node.op == "placeholder":
        return
    for view in reversed(chain):
        node.append(view)
        node = view


def sink_casts(node: fx.Node) -> None:
    """Moves the views and casts that read ``node`` (a collective's wait) down to right before
    their first other user: stage 2 emits a gradient reduced in ``Policy.reduce``'s dtype
    followed at once by its cast back, which would otherwise count as the result's first use
    and close the bucket."""
    for user in list(node.users):
        if user.op != "call_function" or user.target not in MOVABLE or len(user.all_input_nodes) != 1:
            continue
        sink_casts(user)
        if user.users:
            order = {n: k for k, n in enumerate(node.graph.nodes)}
            min(user.users, key=order.__getitem__).prepend(user)


def meta_value(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


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


def last_placeholder(graph: fx.Graph) -> fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


_SMALL = 4096  # elements: the forward's scalars (a token count, a loss sum), never a gradient bucket
# ops that read only their first input's shape, dtype and device (no schema says so); full_like
# is the backward's seed once stage 1 decomposes ones_like on a mesh
_SHAPE_ONLY = frozenset(
    {_aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default, _aten.full_like.default}
)


def _input_cone(node: fx.Node, limit: int = 32) -> list[fx.Node] | None:
    """The ops ``node`` is computed from, if they are few, pure and read only graph inputs (a
    token count read from the labels); ``None`` otherwise."""
    cone, stack = {}, [node]
    while stack:
        n = stack.pop()
        if n in cone or n.op in ("placeholder", "get_attr"):
            continue
        if n.op != "call_function" or not _torch_private.is_pure_op(n.target) or _torch_private.is_collective(n.target):
            return None
        cone[n] = None
        if len(cone) > limit:
            return None
        stack.extend(n.all_input_nodes)
    return list(cone)


def _output_only_tail(wait: fx.Node) -> list[fx.Node] | None:
    """``wait`` and the pure ops after it, if they feed nothing but the graph's outputs."""
    tail, stack = {}, [wait]
    while stack:
        n = stack.pop()
        if n in tail:
            continue
        if n.op != "call_function" or not _torch_private.is_pure_op(n.target):
            return None
        tail[n] = None
        stack.extend(u for u in n.users if u.op != "output")
    return list(tail)


def _hoist(graph: fx.Graph, node: fx.Node, cone: list[fx.Node], anchor: fx.Node) -> fx.Node | None:
    """Moves ``cone`` (in order) and the collective ``node`` right after ``anchor``; returns the
    new anchor, or ``None`` (moving nothing) if that would move one of them before a write to
    memory it reads (a batch leaf updated in place earlier in the step)."""
    accesses = facts.Accesses(graph)
    order = accesses.position
    # (ops an earlier hoist already moved up stay where they are, before their users)
    up = [*sorted((n for n in cone if order[n] > order[anchor]), key=order.__getitem__), node]
    for n in up:
        writer = accesses.crossed(n, order[anchor])
        if writer is not None:
            log.debug("fsg: %s stays: moving %s up would cross the write %s", node.name, n.name, writer.name)
            return None
    for n in up:
        anchor.append(n)
        anchor = n
    return anchor


def _defer(graph: fx.Graph, tail: list[fx.Node]) -> bool:
    """Moves ``tail`` (a wait and the pure ops that read it, feeding only the outputs) as late as
    it may go: right before ``output``, or before the first later write to memory one of them
    reads (a metric read from a parameter that the update's ``copy_`` overwrites must see the
    old value). Returns whether the wait moved down."""
    accesses = facts.Accesses(graph)
    order = accesses.position
    stop = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in tail:
        stop = accesses.next_write(n, order[stop]) or stop
    wait, members = tail[0], set(tail)
    if all(n in members for n in accesses.nodes[order[wait] : order[stop]]):
        return False  # nothing to move past
    blocked = next(((n, w) for n in tail if (w := accesses.crossed(n, order[stop])) is not None), None)
    if blocked is not None:
        log.debug("fsg: %s stays: moving %s down would cross the write %s", wait.name, blocked[0].name, blocked[1].name)
        return False
    if stop.op != "output":
        log.debug("fsg: %s moves down only to %s, which writes memory its readers read", wait.name, stop.name)
    for n in sorted(tail, key=order.__getitem__):
        stop.prepend(n)
    return True


def defer_small_collectives(gm: fx.GraphModule) -> int:
    """Takes the forward's small all-reduces off the step's critical path (see the module
    docstring); returns how many collectives it moved. Run it after the bucketing pass. No node
    moves past a write to memory it reads (``passes.facts``): a batch-only count whose input
    is written in place stays, and a loss metric that also reads a parameter is waited for
    before the update overwrites that parameter."""
    graph = gm.graph
    moved = 0
    anchor = last_placeholder(graph)  # hoisted ops go after it, in order
    for node in list(graph.nodes):
        if node.target is not _torch_private.ALL_REDUCE or not isinstance(node.args[0], fx.Node):
            continue
        value = meta_value(node.args[0])
        if value is None or value.numel() > _SMALL:
            continue
        cone = _input_cone(node.args[0])
        if cone:  # read from the batch only: issue it first thing
            hoisted = _hoist(graph, node, cone, anchor)
            if hoisted is not None:
                anchor = hoisted
                moved += 1
        for wait in [u for u in node.users if u.target is _torch_private.WAIT_TENSOR]:
            for user in list(wait.users):  # the backward's seed reads only the loss's shape
                if user.target in _SHAPE_ONLY:  # an all-reduce's result has its input's shape
                    user.replace_input_with(wait, node.args[0])
            tail = _output_only_tail(wait)
            if tail and wait.users and _defer(graph, tail):
                moved += 1
    graph.lint()
    gm.recompile()
    return moved


def bucket_gradient_collectives(gm: fx.GraphModule, bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Rewrites ``gm`` in place as the module docstring says; returns the number of
    collectives left of those it handled (one per bucket)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _COLLECTIVES:
            _hoist_views(node.args[0])
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
