"""Stage 3 pass on a per-rank graph: the forward's small collectives leave the critical path.

A small all-reduce whose input depends on the batch alone (the token count of a mean loss) is
issued at the step's start, and a wait whose result only feeds the step's outputs (the loss
metric) moves to the step's end. No node moves past a write to memory it reads
(``graph_facts``).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src import graph_facts as facts
from fsg._src.passes.moves import last_placeholder, meta_value

_aten = torch.ops.aten
log = logging.getLogger("fsg")

_SMALL = 4096  # elements: the forward's scalars (a token count, a loss sum), never a gradient bucket
# ops that read only their first input's shape, dtype and device (no schema says so); full_like
# is the backward's seed once stage 1 decomposes ones_like on a mesh
_SHAPE_ONLY = frozenset(
    {_aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default, _aten.full_like.default}
)


def _input_cone(node: fx.Node, batch: set[fx.Node] | None, limit: int = 32) -> list[fx.Node] | None:
    """The ops ``node`` is computed from, if they are few, pure and read only the batch inputs
    (``batch``; every graph input when ``None``): a token count read from the labels. ``None``
    otherwise: a loss that reads a parameter is the forward itself, which must not move."""
    cone, stack = {}, [node]
    while stack:
        n = stack.pop()
        if (n.op == "placeholder" and batch is not None and n not in batch) or n.op == "get_attr":
            return None  # a parameter read (the forward itself) or a constant defined further down
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


def defer_small_collectives(gm: fx.GraphModule, num_state_leaves: int | None = None) -> int:
    """Takes the forward's small all-reduces off the step's critical path (see the module
    docstring); returns how many collectives it moved. Inputs past ``num_state_leaves`` are
    the batch (stage 1's leaf layout; every input counts as batch when ``None``). No node
    moves past a write to memory it reads (``graph_facts``): a batch-only count whose input
    is written in place stays, and a loss metric that also reads a parameter is waited for
    before the update overwrites that parameter."""
    graph = gm.graph
    moved = 0
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    batch = None if num_state_leaves is None else set(inputs[num_state_leaves:])
    anchor = last_placeholder(graph)  # hoisted ops go after it, in order
    for node in list(graph.nodes):
        if node.target is not _torch_private.ALL_REDUCE or not isinstance(node.args[0], fx.Node):
            continue
        value = meta_value(node.args[0])
        if value is None or value.numel() > _SMALL:
            continue
        cone = _input_cone(node.args[0], batch)
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

