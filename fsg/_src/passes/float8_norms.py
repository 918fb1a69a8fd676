"""The layer norms whose kernels compute a rowwise FP8 cast (``passes/float8_fuse.py``): a norm
whose output an FP8 matmul reads (forward), and a norm's backward whose output, plus the
residual stream's gradient, an FP8 grad-input matmul reads (backward).

- Forward: ``native_layer_norm`` (and the residual add it normalizes) becomes
  ``fsg::layer_norm_fp8`` / ``fsg::add_layer_norm_fp8`` (``kernels/layer_norm_fp8.py``).
- Backward: ``native_layer_norm_backward``, the add of the residual stream's gradient that reads
  its ``dx`` (where there is one), the rowwise cast of the sum and, where a bias gradient sums
  it, its column sums become ``fsg::layer_norm_backward_fp8``
  (``kernels/layer_norm_backward_fp8.py``), which returns the norm's weight and bias gradients
  too. In a pre-norm transformer that sum is the output gradient of the linear layer before
  the norm (GPT's ``proj`` and ``fc2``).

A norm matches only where the kernels compute exactly what the graph does: over the last dim,
row-major inputs of one half-precision dtype, the residual of ``dx``'s shape and dtype.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from fsg._src.kernels import layer_norm_backward_fp8, layer_norm_fp8
from fsg._src.passes.float8_graph import column_sums, fused_outputs, read_column_sums, unflattened
from fsg._src.passes.ordering import NodeOrder

aten = torch.ops.aten
LAYER_NORM, LAYER_NORM_BACKWARD = aten.native_layer_norm.default, aten.native_layer_norm_backward.default
ADD = aten.add.Tensor
LAYER_NORM_FP8, ADD_LAYER_NORM_FP8 = torch.ops.fsg.layer_norm_fp8.default, torch.ops.fsg.add_layer_norm_fp8.default
LAYER_NORM_BACKWARD_FP8 = torch.ops.fsg.layer_norm_backward_fp8.default
OUTPUTS = {
    LAYER_NORM_FP8: ("y", "mean", "rstd", "q", "inv"),
    ADD_LAYER_NORM_FP8: ("s", "y", "mean", "rstd", "q", "inv"),
    LAYER_NORM_BACKWARD_FP8: ("dx", "q", "inv", "colsum", "dw", "db"),
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


def fused_norm_backward(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """If ``t`` (its rows flattened to 2-D) is a layer norm backward's ``dx``, or ``r + dx``:
    the backward (and the add) becomes ``fsg::layer_norm_backward_fp8``, whose FP8 copy and
    inverse scales are ``t``'s cast, whose column sums each ``sum(t, [0])`` reads, and whose
    ``dx``, ``dw`` and ``db`` the backward's (and the add's) readers read instead."""
    match = norm_backward_match(t)
    if match is None:
        return
    backward, add, residual, anchor = match
    dy, x, _, mean, rstd, weight, bias, mask = backward.args
    s = unflattened(t)
    sums = bool(column_sums(t))
    with q.graph.inserting_before(anchor):
        fused = q.call(LAYER_NORM_BACKWARD_FP8, (dy, x, mean, rstd, weight, bias, list(mask), residual, sums))
        out = fused_outputs(q, fused, OUTPUTS)
    if add is not None:
        add.replace_all_uses_with(out["dx"])
        q.graph.erase_node(add)
    for item in list(backward.users):  # getitem 0, 1, 2: dx (read by the add alone, if any), dw, db
        item.replace_all_uses_with(out[("dx", "dw", "db")[item.args[1]]])
        q.graph.erase_node(item)
    q.graph.erase_node(backward)
    rows = out["dx"] if t is s else t  # a 2-D sum is t itself: its readers now read dx
    _cast_is(q, t, rows, dtype, out)
    if sums:
        read_column_sums(q, rows, out["colsum"])


def norm_backward_match(t: fx.Node) -> tuple[fx.Node, fx.Node | None, fx.Node | None, fx.Node] | None:
    """``(backward, add, residual, anchor)`` where ``t`` is a flattening view of ``getitem(backward, 0)``
    (``add``, ``residual`` ``None``) or of ``add = residual + getitem(backward, 0)`` (either
    order) and ``fused_norm_backward`` applies: a ``native_layer_norm_backward`` over the last
    dim, in half precision, whose ``dx`` the add alone reads, and whose other outputs' readers
    all run after the point the fused op takes, ``anchor`` (the backward, or the add where the
    residual is computed after the backward)."""
    s = unflattened(t)
    add, residual, item = None, None, s
    if s.op == "call_function" and s.target is ADD and len(s.args) == 2 and not s.kwargs:
        for i in (0, 1):
            if _is_dx(s.args[i]) and isinstance(s.args[1 - i], fx.Node):
                add, item, residual = s, s.args[i], s.args[1 - i]
                break
    if not _is_dx(item) or (add is not None and len(item.users) != 1):
        return None
    backward = item.args[0]
    if len(backward.args) != 8 or backward.kwargs:
        return None
    dy, x, shape, mean, rstd, weight, bias, mask = backward.args
    if not all(isinstance(v, fx.Node) for v in (dy, x, mean, rstd)) or not mask[0]:
        return None
    x_val, dy_val, t_val = x.meta["val"], dy.meta["val"], t.meta["val"]
    N = x_val.shape[-1] if x_val.dim() else None
    if list(shape) != [N] or x_val.dtype not in layer_norm_backward_fp8.DTYPES or dy_val.dtype != x_val.dtype:
        return None
    if dy_val.shape != x_val.shape or not (x_val.is_contiguous() and dy_val.is_contiguous()):
        return None
    if t_val.dim() != 2 or t_val.shape[1] != N or not all(isinstance(u.args[1], int) for u in backward.users):
        return None
    if residual is not None:
        r_val = residual.meta["val"]
        if r_val.shape != x_val.shape or r_val.dtype != x_val.dtype:
            return None
        order = NodeOrder(backward.graph)
        if not order.before(residual, backward):  # the fused op takes the add's place
            later = [user for item in backward.users if item.args[1] for user in item.users]  # dw's, db's readers
            return (backward, add, residual, add) if all(order.before(add, user) for user in later) else None
    return backward, add, residual, backward


def _is_dx(node: Any) -> bool:
    """Whether ``node`` is ``getitem(native_layer_norm_backward(...), 0)``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return False
    backward = node.args[0]
    return node.args[1] == 0 and isinstance(backward, fx.Node) and backward.target is LAYER_NORM_BACKWARD
