"""Graph helpers the float8 pass's fusions share (``passes/float8/fuse.py``,
``passes/float8/norms.py``): a tensor's rows through flattening views, the bias gradients that
sum its columns, and a fused op's outputs by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsg._src.passes.patterns import FLATTENS

aten = torch.ops.aten
SUM_DIM = aten.sum.dim_IntList


def unflattened(t: fx.Node) -> fx.Node:
    """The node ``t`` is a chain of flattening views of (``t`` itself if none)."""
    while t.op == "call_function" and t.target in FLATTENS:
        t = t.args[0]
    return t


def fused_outputs(q: Any, fused: fx.Node, names: dict) -> dict[str, fx.Node]:
    """A fused op's outputs by name (``names[fused.target]``: the names in the op's order)."""
    return {name: q.item(fused, i) for i, name in enumerate(names[fused.target])}


def column_sums(t: fx.Node) -> list[fx.Node]:
    """The users of 2-D ``t`` that sum its columns (``sum(t, [0])``: a bias gradient)."""

    def sums_columns(user: fx.Node) -> bool:
        dims = user.args[1] if len(user.args) > 1 else None
        return user.target is SUM_DIM and list(dims or ()) in ([0], [-2]) and user.kwargs.get("dtype") is None

    return [user for user in t.users if sums_columns(user)]


def read_column_sums(q: Any, t: fx.Node, colsum: fx.Node) -> None:
    """Each ``sum(t, [0])`` becomes the fused op's float32 ``colsum`` in its own dtype."""
    for user in column_sums(t):
        with q.graph.inserting_before(user):
            out = q.call(aten._to_copy.default, (colsum,), {"dtype": user.meta["val"].dtype})
            if user.meta["val"].dim() == 2:  # keepdim
                out = q.call(aten.view.default, (out, list(user.meta["val"].shape)))
        user.replace_all_uses_with(out)
        q.graph.erase_node(user)
