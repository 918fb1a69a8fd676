"""The layer norms whose kernel computes a rowwise FP8 cast (``passes/float8/fuse.py``): a norm
whose output an FP8 matmul reads. ``native_layer_norm`` (and the residual add it normalizes)
becomes ``fsg::layer_norm_fp8`` / ``fsg::add_layer_norm_fp8`` (``kernels/fp8/layer_norm.py``).

A norm matches only where the kernel computes exactly what the graph does: over the last dim,
row-major inputs of one half-precision dtype.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from fsg._src.kernels.fp8 import layer_norm as layer_norm_fp8
from fsg._src.passes.float8.graph import fused_outputs, unflattened

aten = torch.ops.aten
LAYER_NORM = aten.native_layer_norm.default
ADD = aten.add.Tensor
LAYER_NORM_FP8, ADD_LAYER_NORM_FP8 = torch.ops.fsg.layer_norm_fp8.default, torch.ops.fsg.add_layer_norm_fp8.default
OUTPUTS = {
    LAYER_NORM_FP8: ("y", "mean", "rstd", "q", "inv"),
    ADD_LAYER_NORM_FP8: ("s", "y", "mean", "rstd", "q", "inv"),
}


def _cast_is(q: Any, t: fx.Node, rows: fx.Node, dtype: torch.dtype, out: dict[str, fx.Node]) -> None:
    for key in {(t, False, dtype), (rows, False, dtype)}:
        q.casts[key], q.scales[key] = out["q"], out["inv"]


def fused_layer_norm(q: Any, t: fx.Node, dtype: torch.dtype, residual_adds: bool) -> None:
    """If ``t`` (its rows flattened to 2-D) is a layer norm's output, normalized over its last
    dim in half precision: the norm becomes ``fsg::layer_norm_fp8`` (with ``residual_adds``,
    ``fsg::add_layer_norm_fp8`` where it normalizes a residual add), whose FP8 copy and inverse
    scales are ``t``'s cast and whose ``y``, mean and rstd the norm's readers (the norm's
    backward among them) read instead."""
    y = layer_norm_match(t)
    if y is None:
        return
    norm = y.args[0]
    x, _, weight, bias, eps = norm.args
    add = residual_add(x, norm) if residual_adds else None
    with q.graph.inserting_before(norm):
        if add is None:
            out = fused_outputs(q, q.call(LAYER_NORM_FP8, (x, weight, bias, eps)), OUTPUTS)
        else:
            out = fused_outputs(q, q.call(ADD_LAYER_NORM_FP8, (*add.args, weight, bias, eps)), OUTPUTS)
            add.replace_all_uses_with(out["s"])
            q.graph.erase_node(add)
    for item in list(norm.users):  # getitem 0, 1, 2: y, mean, rstd
        item.replace_all_uses_with(out[("y", "mean", "rstd")[item.args[1]]])
        q.graph.erase_node(item)
    q.graph.erase_node(norm)
    _cast_is(q, t, out["y"] if t is y else t, dtype, out)  # a 2-D norm's output is t itself: its readers read y


def layer_norm_match(t: fx.Node) -> fx.Node | None:
    """The norm's ``getitem(native_layer_norm(...), 0)`` ``t`` is a flattening view of, where
    ``fused_layer_norm`` applies (normalized over the last dim, in half precision)."""
    y = unflattened(t)
    if not (y.op == "call_function" and y.target is operator.getitem and y.args[1] == 0):
        return None
    norm = y.args[0]
    if not (isinstance(norm, fx.Node) and norm.op == "call_function" and norm.target is LAYER_NORM):
        return None
    if norm.kwargs or len(norm.args) != 5:
        return None
    x, shape, weight, bias, _ = norm.args
    x_val, t_val = x.meta["val"], t.meta["val"]
    N = x_val.shape[-1] if x_val.dim() else None
    if list(shape) != [N] or x_val.dtype not in layer_norm_fp8.DTYPES or not x_val.is_contiguous():
        return None
    if t_val.dim() != 2 or t_val.shape[1] != N or not all(isinstance(u.args[1], int) for u in norm.users):
        return None
    if any(
        v is not None and (not isinstance(v, fx.Node) or tuple(v.meta["val"].shape) != (N,)) for v in (weight, bias)
    ):
        return None
    return y


def residual_add(x: fx.Node, norm: fx.Node) -> fx.Node | None:
    """``x`` if it is ``a + b`` of two tensors of its shape and dtype (a residual stream's add)
    that nothing reads before ``norm`` does: the fused norm computes and writes the sum."""
    if not (x.op == "call_function" and x.target is ADD and len(x.args) == 2 and not x.kwargs):
        return None
    val = x.meta["val"]
    for a in x.args:
        if not isinstance(a, fx.Node) or a.meta["val"].shape != val.shape or a.meta["val"].dtype != val.dtype:
            return None
    node = x.next
    while node is not norm:  # a reader between the add and the norm would run before the sum exists
        if node in x.users or node.op == "output":
            return None
        node = node.next
    return x
