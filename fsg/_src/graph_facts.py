"""What each node of an aten FX graph reads, writes and aliases, from its op's schema.

A node's *storage* is the root of the view chain it sits on: ``storage_of(view(t(p)))`` is the
placeholder ``p``, ``storage_of(copy_(p, x))`` too (an in-place op returns its written
argument). A *view* (schema ``Tensor(a) self -> Tensor(a)``, or ``operator.getitem`` of a list
of views) reads no data; every other op reads the storages of its tensor inputs, and an op with
``Tensor(a!)`` arguments writes theirs. Facts come from ``_torch_private.mutated_args`` and
``aliased_args``, never from a list of op names, so a new view or in-place op needs no change
here. Python targets other than ``getitem`` are taken to read their inputs and write nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

from torch import fx

from fsg._src import _torch_private


def _nodes(value: Any) -> Iterator[fx.Node]:
    """The FX nodes in an argument (a node, or a list or tuple of them, as ``Tensor[]`` is)."""
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _nodes(item)


def _schema_args(node: fx.Node, indices: frozenset[int]) -> Iterator[fx.Node]:
    """The nodes passed at ``indices`` of ``node``'s schema, positionally or by keyword."""
    names = _torch_private.arg_names(node.target)
    for i in indices:
        if i < len(node.args):
            yield from _nodes(node.args[i])
        elif i < len(names) and names[i] in node.kwargs:
            yield from _nodes(node.kwargs[names[i]])


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s result shares (a view's base, an in-place op's written
    argument, the list of views ``getitem`` picks from), or ``None`` for a new tensor."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent = node.args[0]
        return parent if isinstance(parent, fx.Node) and aliased_input(parent) is not None else None
    return next(_schema_args(node, _torch_private.aliased_args(node.target)), None)


def storage_of(node: fx.Node) -> fx.Node:
    """The node that owns the memory ``node`` reads or writes: a placeholder, or the op that
    made a new tensor, found by following views and in-place results up."""
    while (base := aliased_input(node)) is not None:
        node = base
    return node


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` only renames memory (a view, ``getitem`` of a list of views): it reads no
    data, so moving it past a write changes nothing its readers see."""
    if node.op != "call_function" or _torch_private.mutated_args(node.target):
        return False
    return node.target is operator.getitem or bool(_torch_private.aliased_args(node.target))


def writes(node: fx.Node) -> set[fx.Node]:
    """The storages ``node`` writes in place (``copy_``'s destination, a fused update's lists)."""
    if node.op != "call_function":
        return set()
    return {storage_of(n) for n in _schema_args(node, _torch_private.mutated_args(node.target))}


def reads(node: fx.Node) -> set[fx.Node]:
    """The storages whose data ``node`` reads (none for a view, a placeholder or ``output``:
    the outputs are read after every node)."""
    if node.op != "call_function" or is_view(node):
        return set()
    return {storage_of(n) for n in node.all_input_nodes}


class Accesses:
    """The graph's reads and writes in node order, to ask whether moving a node crosses a write
    to memory it reads (or, for a node that writes, any access to memory it writes). Built
    once; stale after the graph changes (build a new one)."""

    def __init__(self, graph: fx.Graph):
        self.nodes = list(graph.nodes)
        self.position = {n: k for k, n in enumerate(self.nodes)}
        self._writers = [(self.position[n], n, w) for n in self.nodes if (w := writes(n))]

    def next_write(self, node: fx.Node, end: int) -> fx.Node | None:
        """The first node after ``node`` and before position ``end`` that writes memory
        ``node`` reads; ``None`` if there is none."""
        here, read = self.position[node], reads(node)
        return next((w for k, w, written in self._writers if here < k < end and read & written), None)

    def crossed(self, node: fx.Node, to: int) -> fx.Node | None:
        """The first node strictly between ``node``'s position and position ``to`` that writes a
        storage ``node`` reads or writes, or (if ``node`` writes) reads or writes one it
        writes; ``None`` when ``node`` may move there."""
        here = self.position[node]
        lo, hi = min(here, to), max(here, to)
        touched, written = reads(node) | writes(node), writes(node)
        for k, writer, w in self._writers:
            if lo < k < hi and touched & w:
                return writer
        if written:
            for other in self.nodes[lo + 1 : hi]:
                if other is not node and written & (reads(other) | writes(other)):
                    return other
        return None
