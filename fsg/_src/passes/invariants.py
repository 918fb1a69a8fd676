"""The invariants every stage-3 pass keeps, checked by comparing the graph before and after it.

1. **Reads and writes of a storage keep their order.** For each storage (``facts.storage_of``:
   a placeholder, or the op that made a tensor), a node that read or wrote it before a write
   still does so before that write, and one after it still after; a node that saw no write yet
   (the step's input value) still sees none, even of a write the pass added, and one that saw a
   write still sees one. Nodes the pass added or removed are compared through the ones that
   stayed, matched by name (FX never reuses a node name in a graph).
2. **Every functional collective is waited for**: exactly one ``wait_tensor`` on its result
   (on each ``getitem`` of a list result), and no op reads the result before that wait.
3. **The graph is well formed** (``Graph.lint``: every input defined before it is used) and has
   as many outputs as before.

``snapshot(graph)`` records what is compared; ``check(snapshot, graph, pass_name)`` raises
``PassInvariantError`` naming the pass, the storage and the two nodes whose order changed.

>>> import torch
>>> from torch import fx
>>> g = fx.Graph()
>>> p, new = g.placeholder("p"), g.placeholder("new")
>>> y = g.call_function(torch.ops.aten.mul.Tensor, (p, 2.0))
>>> w = g.call_function(torch.ops.aten.copy_.default, (p, new))
>>> _ = g.output((y,))
>>> before = snapshot(g)
>>> w.append(y)  # a "pass" that moves the read after the write
>>> check(before, g, "bad")
Traceback (most recent call last):
...
fsg._src.errors.PassInvariantError: pass 'bad' changed the order of 'mul_tensor' and 'copy__default' on
the storage of placeholder 'p': 'mul_tensor' read it before 'copy__default' wrote it, and now after ...
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from torch import fx

from fsg._src import _torch_private
from fsg._src import graph_facts as facts
from fsg._src.errors import PassInvariantError
from fsg._src.passes.ordering import NodeOrder

_ORDER_RULE = "a pass may move a node only where it sees the same writes to the memory it reads"
_WAIT_RULE = "every functional collective needs exactly one wait_tensor, before any read of its result"
_BUG = (
    "This is a bug in fsg's graph passes: please report it with the step's graphs (Step.lower); "
    "FSG_CHECK_PASSES=1 runs this check after every pass."
)


class Snapshot(NamedTuple):
    """What ``check`` compares, for a graph at one moment (names, not node objects, so that a
    pass may work on a copy)."""

    position: dict[str, int]
    # storage name -> {name of a node that reads or writes it: whether it writes}
    accesses: dict[str, dict[str, bool]]
    kinds: dict[str, str]  # storage name -> how to name it in an error
    outputs: int
    collective_errors: dict[str, str]  # collective name -> what is wrong with its waits


def _outputs(graph: fx.Graph) -> int:
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    value = output.args[0]
    return len(value) if isinstance(value, (list, tuple)) else 1


def _collective_errors(graph: fx.Graph) -> dict[str, str]:
    """Each functional collective whose result is not waited for exactly once before it is read."""
    order = NodeOrder(graph)
    errors = {}
    for node in graph.nodes:
        if node.op != "call_function" or not _torch_private.is_collective(node.target):
            continue
        if node.target is _torch_private.WAIT_TENSOR:
            continue
        results = [u for u in node.users if u.target is operator.getitem] or [node]
        for result in results:
            waits = [u for u in result.users if u.target is _torch_private.WAIT_TENSOR]
            if len(waits) != 1:
                errors[node.name] = f"has {len(waits)} wait_tensor nodes on its result {result.name!r} (needs 1)"
                break
            early = [
                u
                for u in result.users
                if u is not waits[0] and not facts.is_view(u) and u.op != "output" and order.before(u, waits[0])
            ]
            if early:
                errors[node.name] = f"has its result read by {early[0].name!r} before its wait {waits[0].name!r}"
                break
    return errors


def _describe(storage: fx.Node) -> str:
    if storage.op == "placeholder":
        return f"placeholder {storage.name!r}"
    target = storage.target
    op = target if isinstance(target, _torch_private.OpOverload) else getattr(target, "__name__", target)
    return f"{storage.name!r} (made by {op})"


def snapshot(graph: fx.Graph) -> Snapshot:
    """Records ``graph``'s node order, who reads and writes each storage, its output count and
    any collective already without its wait."""
    position, accesses, kinds = {}, {}, {}
    for k, node in enumerate(graph.nodes):
        position[node.name] = k
        written = facts.writes(node)
        for storage in facts.reads(node) | written:
            accesses.setdefault(storage.name, {})[node.name] = storage in written
            kinds[storage.name] = _describe(storage)
    return Snapshot(position, accesses, kinds, _outputs(graph), _collective_errors(graph))


def _fail(pass_name: str, message: str, rule: str | None = None) -> PassInvariantError:
    rule = f" ({rule})" if rule else ""
    return PassInvariantError(f"pass {pass_name!r} {message}{rule}. {_BUG}")


def _verb(writes: bool) -> str:
    return "wrote" if writes else "read"


def _check_order(before: Snapshot, after: Snapshot, pass_name: str) -> None:
    for storage, seen in before.accesses.items():
        now = after.accesses.get(storage, {})
        what = f"the storage of {before.kinds[storage]}"
        kept = [n for n in seen if n in now]  # accesses in both graphs
        writers_before = [n for n in seen if seen[n]]
        writers_after = [n for n in now if now[n]]
        for writer in writers_before:
            if writer not in now or not now[writer]:
                continue
            for node in kept:
                if node == writer:
                    continue
                was_first = before.position[node] < before.position[writer]
                if was_first != (after.position[node] < after.position[writer]):
                    first, second = (node, writer) if was_first else (writer, node)
                    raise _fail(
                        pass_name,
                        f"changed the order of {first!r} and {second!r} on {what}: {first!r} "
                        f"{_verb(seen[first])} it before {second!r} {_verb(seen[second])} it, and now after",
                        _ORDER_RULE,
                    )
        for node in kept:
            saw_before = [w for w in writers_before if w != node and before.position[w] < before.position[node]]
            saw_after = [w for w in writers_after if w != node and after.position[w] < after.position[node]]
            if bool(saw_before) != bool(saw_after):
                if saw_after:
                    change = f"{saw_after[0]!r} now writes it first"
                else:
                    change = f"no write comes before it any more ({saw_before[0]!r} did)"
                raise _fail(
                    pass_name,
                    f"changed the value {node!r} sees of {what}: it {_verb(seen[node])} it "
                    f"{'after a write' if saw_before else 'before any write'}, and {change}",
                    _ORDER_RULE,
                )


def check(before: Snapshot | fx.Graph, graph: fx.Graph, pass_name: str) -> None:
    """Raises ``PassInvariantError`` if ``graph`` (after pass ``pass_name``) breaks one of the
    invariants of the module docstring relative to ``before`` (a ``snapshot`` taken before the
    pass, or a copy of the graph then)."""
    if isinstance(before, fx.Graph):
        before = snapshot(before)
    try:
        graph.lint()
    except RuntimeError as exc:  # lint raises RuntimeError for a node used before it is defined
        raise _fail(pass_name, f"left a malformed graph ({str(exc).splitlines()[0]})") from exc
    after = snapshot(graph)
    if after.outputs != before.outputs:
        raise _fail(pass_name, f"changed the number of outputs from {before.outputs} to {after.outputs}")
    for name, error in after.collective_errors.items():
        if name not in before.collective_errors:
            raise _fail(pass_name, f"left the collective {name!r} unwaited: it {error}", _WAIT_RULE)
    _check_order(before, after, pass_name)
