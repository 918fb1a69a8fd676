"""Accumulating ``index_put`` on CPU as ``scatter_add``: a workaround for an Inductor miscompile.

Inductor's C++ code for ``index_put(self, [None, ..., idx], values, accumulate=True)`` reads
``values`` through the wrong strides when ``values`` is a permuted view: the step computes
wrong gradients and writes out of bounds (seen on torch 2.13's CPU build: a gradient 2.9%
off float64 and heap corruption). The pattern is the backward of ``x[..., [i], :]``; Falcon's
multi-query attention takes its key and value heads that way, and ``torch.compile`` of the
model computes the same wrong gradient. ``scatter_add`` along the indexed dim is the same
sum and compiles correctly, so stage 4 rewrites each such node before handing the graph to
Inductor on CPU (``tests/test_index_put.py`` checks both, the compiled gradient in a child process). On CUDA the
graph is left as it is: the miscompile was not seen there (not tested).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsg._src import _torch_private

_aten = torch.ops.aten
_INDEX_PUT = _aten.index_put.default


def _one_index(node: fx.Node) -> tuple[int, fx.Node] | None:
    """``(dim, index)`` when ``node`` is an accumulating CPU ``index_put`` with one 1-D integer
    index tensor (every other entry a whole dim); else ``None``."""
    if node.op != "call_function" or node.target is not _INDEX_PUT:
        return None
    self_, indices, _values, *rest = node.args
    accumulate = rest[0] if rest else node.kwargs.get("accumulate", False)
    if not accumulate or self_.meta["val"].device.type != "cpu":
        return None
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(given) != 1 or not isinstance(given[0][1], fx.Node):
        return None
    d, index = given[0]
    val = index.meta.get("val")
    if val is None or val.dim() != 1 or val.dtype not in (torch.int64, torch.int32):
        return None
    return d, index


def scatter_accumulating_index_puts(gm: fx.GraphModule) -> int:
    """Rewrites ``gm`` in place (see the module docstring); returns how many nodes it rewrote."""
    mode = _torch_private.fake_mode()

    def call(target: Any, args: tuple) -> fx.Node:
        new = gm.graph.call_function(target, args)
        new.meta["val"] = _torch_private.fake_result(mode, target, args)
        return new

    rewritten = 0
    for node in list(gm.graph.nodes):
        found = _one_index(node)
        if found is None:
            continue
        d, index = found
        self_, values = node.args[0], node.args[2]
        shape = list(self_.meta["val"].shape)
        size, shape[d] = shape[d], index.meta["val"].shape[0]
        with gm.graph.inserting_before(node):
            wrapped = call(_aten.where.self, (call(_aten.lt.Scalar, (index, 0)), call(_aten.add.Scalar, (index, size)), index))
            along = call(_aten.view.default, (wrapped, [shape[d] if i == d else 1 for i in range(len(shape))]))
            where = call(_aten.expand.default, (along, shape))
            spread = call(_aten.expand.default, (values, shape))
            out = call(_aten.scatter_add.default, (self_, d, where, spread))
        out.meta = {**node.meta, "val": out.meta["val"]}
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
