"""Where each node sits in a graph, for the passes that compare, sort and move nodes.

FX keeps a graph's nodes in a linked list with no positions, so each pass built its own
``{node: k for k, node in enumerate(graph.nodes)}`` table, and a table kept across a move or an
insertion went stale without a word (one once left a parameter's cast after the collective that
reads it: ``tests/test_overlap.py``). ``NodeOrder`` is the one such table (issue 15): it is
built on first use, and the code that moves, inserts or erases nodes calls ``invalidate()``,
after which the next question rebuilds it. A question asked of a table that has missed an
insertion or an erasure (the graph's node count changed) raises instead of answering; a missed
move cannot be seen that cheaply, hence the explicit calls.

>>> import torch
>>> from torch import fx
>>> g = fx.Graph()
>>> x = g.placeholder("x")
>>> a = g.call_function(torch.ops.aten.neg.default, (x,))
>>> b = g.call_function(torch.ops.aten.relu.default, (x,))
>>> _ = g.output((a, b))
>>> order = NodeOrder(g)
>>> order.before(a, b), order.position(b)
(True, 2)
>>> a.prepend(b)  # a move: the table is stale until invalidated
>>> order.invalidate()
>>> order.before(a, b), order.first([a, b]) is b
(False, True)
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx


class NodeOrder:
    """The positions of ``graph``'s nodes, computed lazily and kept until ``invalidate()``."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self._position: dict[fx.Node, int] | None = None

    def invalidate(self) -> None:
        """Forgets the positions: call it after moving, inserting or erasing nodes."""
        self._position = None

    def position(self, node: fx.Node) -> int:
        """``node``'s index in the graph's node list."""
        if self._position is None:
            self._position = {n: k for k, n in enumerate(self.graph.nodes)}
        elif len(self._position) != len(self.graph.nodes):
            raise RuntimeError(
                f"stale NodeOrder: the graph has {len(self.graph.nodes)} nodes, its table {len(self._position)}; "
                f"call invalidate() after inserting or erasing nodes"
            )
        return self._position[node]

    def before(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether ``a`` comes strictly before ``b``."""
        return self.position(a) < self.position(b)

    def sorted(self, nodes: Iterable[fx.Node]) -> list[fx.Node]:
        """``nodes`` in graph order."""
        return sorted(nodes, key=self.position)

    def first(self, nodes: Iterable[fx.Node], default: fx.Node | None = None) -> fx.Node | None:
        """The earliest of ``nodes`` (``default`` when there are none)."""
        return min(nodes, key=self.position, default=default)

    def last(self, nodes: Iterable[fx.Node]) -> fx.Node:
        """The latest of ``nodes`` (at least one)."""
        return max(nodes, key=self.position)

    def __len__(self) -> int:
        return len(self.graph.nodes)
