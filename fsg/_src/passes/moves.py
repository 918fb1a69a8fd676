"""Moving the views and casts around a collective: shared by the gradient buckets
(``buckets.py``), the parameter gathers (``prefetch.py``) and ``defer.py``.

A collective's input often reaches it through views and a dtype cast that stage 2 emits where
the gradient is marked (after the whole backward); moving that chain with the collective
keeps it from pinning the collective there.
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src.passes.ordering import NodeOrder

_aten = torch.ops.aten
VIEWS = frozenset(  # the single-input views (and detach) of the graphs the passes see
    {_aten.t.default, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.permute.default,
     _aten.transpose.int, _aten.squeeze.dim, _aten.unsqueeze.default, _aten.alias.default, _aten.detach.default}
)  # fmt: skip
# views, plus the dtype cast: the pure single-input ops moved with a collective's input or result
MOVABLE = VIEWS | {_aten._to_copy.default}


def hoist_views(node: fx.Node, order: NodeOrder | None = None) -> None:
    """Moves the chain of view ops and dtype casts that ends in ``node`` right after the op
    that produced its data: stage 2 emits those views where the gradient is marked, after the
    whole backward, which would pin the collective there too. The casts are mixed precision's:
    a float32 parameter is cast to bf16 before the forward, so autograd runs the backward of
    that cast (the bf16 gradient cast to float32) after the whole backward; left there, it
    made every bucket wait for the end of the backward. ``order`` (the pass's) is invalidated
    when the chain moves."""
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
    if chain and order is not None:
        order.invalidate()


def sink_casts(node: fx.Node, order: NodeOrder | None = None) -> None:
    """Moves the views and casts that read ``node`` (a collective's wait) down to right before
    their first other user: stage 2 emits a gradient reduced in ``Policy.reduce``'s dtype
    followed at once by its cast back, which would otherwise count as the result's first use
    and close the bucket. ``order`` (the pass's, if it has one) is invalidated after each move."""
    order = NodeOrder(node.graph) if order is None else order
    for user in list(node.users):
        if user.op != "call_function" or user.target not in MOVABLE or len(user.all_input_nodes) != 1:
            continue
        sink_casts(user, order)
        if user.users:
            order.first(user.users).prepend(user)
            order.invalidate()


def meta_value(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def last_placeholder(graph: fx.Graph) -> fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]
