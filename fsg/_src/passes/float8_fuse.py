"""Where the float8 pass computes a rowwise cast in one kernel with what surrounds it
(``kernels/float8_cast.py``'s ops), instead of leaving each cast to Inductor as its own
reductions over the tensor.

- A rowwise operand whose producer is in ``FUSED_PRODUCERS`` (a GELU gradient, a GELU, a
  concatenation of row pieces, a gated MLP's ``act(x) * h`` and its gate's gradient:
  ``passes/float8_producers.py``): the producer, its cast and, where a bias gradient sums the
  tensor, its column sums become one op.
- A rowwise operand a layer norm produces (with ``FUSE_LAYER_NORMS``): the norm and the cast
  of its output become one op (``fsg::layer_norm_fp8``), which returns the norm's statistics too.
- Any other rowwise operand a bias gradient sums (the residual stream's gradient): its cast
  and column sums become one op (``fsg::rowwise_fp8``).
- With ``FUSE_COLUMN_AMAX`` (off: measured slower, below), either op also returns the
  tensor's column maxima of ``|t|`` where a grad-weight matmul reads ``t`` transposed in FP8
  (``Float8(grad_weight="fp8")``): the transposed cast's scales, so that cast needs no column
  reduction of its own.

Each result equals the unfused graph's bit for bit in its maxima and to rounding in its sums
(``tests/test_float8.py``). The flags below turn each fusion off (``benchmarks/gpt.py``'s A/B
implementations; the tests compare fused and unfused steps).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from fsg._src.kernels import float8_cast, layer_norm_fp8
from fsg._src.passes import float8_producers as producers

aten = torch.ops.aten
_FLATTENS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
GELU, GELU_BACKWARD, CAT, SUM_DIM = producers.GELU, producers.GELU_BACKWARD, producers.CAT, aten.sum.dim_IntList
ROWWISE_FP8 = torch.ops.fsg.rowwise_fp8.default
LAYER_NORM, LAYER_NORM_FP8 = aten.native_layer_norm.default, torch.ops.fsg.layer_norm_fp8.default
ADD, ADD_LAYER_NORM_FP8 = aten.add.Tensor, torch.ops.fsg.add_layer_norm_fp8.default
# what each op returns, by name (g: the producer's output; colamax: [0] unless asked)
OUTPUTS = {
    producers.GELU_BACKWARD_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GELU_FP8: ("g", "q", "inv", "colamax"),
    producers.CAT_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GATED_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GATED_BACKWARD_FP8: ("g", "q", "inv", "colsum", "colamax"),
    ROWWISE_FP8: ("q", "inv", "colsum", "colamax"),
    LAYER_NORM_FP8: ("y", "mean", "rstd", "q", "inv"),
    ADD_LAYER_NORM_FP8: ("s", "y", "mean", "rstd", "q", "inv"),
}
# a rowwise operand's producer (each op in FUSED_PRODUCERS), its cast and column sums in one kernel
FUSE_PRODUCERS = True
FUSED_PRODUCERS = producers.PRODUCERS
# a rowwise operand a layer norm writes: the norm and its cast in one kernel (one read of the
# norm's input), with the residual add it normalizes (``LN(x + r)``, ``fsg::add_layer_norm_fp8``,
# which writes the sum too). On since 2026-12-06 (RESULTS.md): 355M 70.63-70.77 against 71.42 ms
# on the H200, 1.3B 199.70-199.92 against 202.81 ms on an H100, 0.8-1.6 GiB lower peaks, and a
# 500-step run within bf16's loss
FUSE_LAYER_NORMS = True
FUSE_RESIDUAL_ADDS = True
# any other rowwise operand with a bias gradient: its cast and column sums (H200, RESULTS.md: 75.43
# against 76.04 ms at GPT-2 355M, 202.04 against 204.67 ms at 1.3B with FP8 grad-weights)
FUSE_COLUMN_SUMS = True
# the column maxima of a fused op's tensor that a grad-weight reads transposed in FP8: measured
# slower, so off (H200, 2026-12-03, fsg-fp8-row-gw against -nocolamax in one run: 80.90 against
# 79.83 ms at GPT-2 355M, 200.85 against 199.67 ms at 1.3B; the kernel's maxima, folded by
# atomic max or stored as a partial row per program, cost it more than Inductor's reductions)
FUSE_COLUMN_AMAX = False


def rows_base(t: fx.Node) -> fx.Node:
    """The tensor whose rows ``t``'s are: up through the flattening views that keep the row
    width, as far as the tensor viewed is contiguous (so row ``i`` of each is the same
    memory). A fused op's column maxima, keyed by this tensor, serve every such view."""
    while t.op == "call_function" and t.target in _FLATTENS and isinstance(src := t.args[0], fx.Node):
        val, src_val = t.meta["val"], src.meta["val"]
        if src_val.dim() < 1 or src_val.shape[-1] != val.shape[-1] or not src_val.is_contiguous():
            break
        t = src
    return t


def fuse(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """Computes ``t``'s row-major rowwise cast (``q.casts[(t, False, dtype)]``) in a fused op
    where one applies; leaves it unset otherwise (the generic cast follows)."""
    if dtype != float8_cast.E4M3:
        return
    if FUSE_LAYER_NORMS:
        fused_layer_norm(q, t, dtype)
    if FUSE_PRODUCERS and (t, False, dtype) not in q.casts:
        fused_producer(q, t, dtype)
    if (t, False, dtype) not in q.casts and FUSE_COLUMN_SUMS:
        fused_column_sums(q, t, dtype)


def fused_producer(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """If ``t`` (its rows flattened to 2-D) is the output of an op a kernel fuses with the cast
    (``FUSED_PRODUCERS``: a GELU gradient, a GELU, a concatenation along the rows, a gated
    MLP's product or gradient; ``passes/float8_producers.py``), computes it, its rowwise FP8
    copy and, where a bias gradient sums it, its column sums in one kernel: the op becomes the
    fused op, whose copy and inverse scales are ``t``'s cast, and each ``sum(t, [0])`` reads
    the fused column sums."""
    match = producer_match(t)
    if match is None:
        return
    producer, op, args = match
    column_amax = FUSE_COLUMN_AMAX and rows_base(t) is producer and producer in q.flipped
    sums = (bool(column_sums(t)),) if op in producers.TAKES_COLUMN_SUMS else ()
    inputs = producer.all_input_nodes
    with q.graph.inserting_before(producer.next):
        fused = q.call(op, (*args, *sums, column_amax))
        out = outputs(q, fused)
        producer.replace_all_uses_with(out["g"])
        q.graph.erase_node(producer)
    for node in inputs:  # what the fused op computes itself (an activation, a product), where nothing else reads it
        if node.op == "call_function" and node.target in producers.ABSORBED and not node.users:
            q.graph.erase_node(node)
    rows = out["g"] if t is producer else t  # a 2-D producer is t itself: its readers now read g
    for key in {(t, False, dtype), (rows, False, dtype)}:
        q.casts[key], q.scales[key] = out["q"], out["inv"]
    if "colsum" in out:
        read_column_sums(q, rows, out["colsum"])
    if column_amax:
        q.column_amax[out["g"]] = out["colamax"]


def fused_layer_norm(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """If ``t`` (its rows flattened to 2-D) is a layer norm's output, normalized over its last
    dim in half precision: the norm becomes ``fsg::layer_norm_fp8``, whose FP8 copy and inverse
    scales are ``t``'s cast and whose ``y``, mean and rstd the norm's readers (the norm's
    backward among them) read instead."""
    y = layer_norm_match(t)
    if y is None:
        return
    norm = y.args[0]
    x, _, weight, bias, eps = norm.args
    add = residual_add(x, norm) if FUSE_RESIDUAL_ADDS else None
    with q.graph.inserting_before(norm):
        if add is None:
            out = outputs(q, q.call(LAYER_NORM_FP8, (x, weight, bias, eps)))
        else:
            out = outputs(q, q.call(ADD_LAYER_NORM_FP8, (*add.args, weight, bias, eps)))
            add.replace_all_uses_with(out["s"])
            q.graph.erase_node(add)
    for item in list(norm.users):  # getitem 0, 1, 2: y, mean, rstd
        item.replace_all_uses_with(out[("y", "mean", "rstd")[item.args[1]]])
        q.graph.erase_node(item)
    q.graph.erase_node(norm)
    rows = out["y"] if t is y else t  # a 2-D norm's output is t itself: its readers now read y
    for key in {(t, False, dtype), (rows, False, dtype)}:
        q.casts[key], q.scales[key] = out["q"], out["inv"]


def fusable(t: fx.Node, dtype: torch.dtype) -> str | None:
    """What ``fuse`` would compute ``t``'s row-major rowwise cast in (``"layer norm"``, a
    producer's op name, ``"column sums"``), or ``None`` for the generic cast: the graph is not
    changed (``passes/float8_cost.py`` prices a fused cast by the bytes it adds)."""
    if dtype != float8_cast.E4M3:
        return None
    if FUSE_LAYER_NORMS and layer_norm_match(t) is not None:
        return "layer norm"
    if FUSE_PRODUCERS and (match := producer_match(t)) is not None:
        return str(match[0].target)
    val = t.meta["val"]
    if FUSE_COLUMN_SUMS and val.dim() == 2 and val.is_contiguous() and column_sums(t):
        return "column sums"
    return None


def _unflattened(t: fx.Node) -> fx.Node:
    while t.op == "call_function" and t.target in _FLATTENS:
        t = t.args[0]
    return t


def producer_match(t: fx.Node) -> tuple[fx.Node, Any, tuple] | None:
    """``t``'s producer (through flattening views), its fused op and the op's arguments, where
    ``fused_producer`` applies."""
    producer = _unflattened(t)
    if producer.op != "call_function" or producer.target not in FUSED_PRODUCERS:
        return None
    g_val, t_val = producer.meta["val"], t.meta["val"]
    if g_val.dim() < 2 or t_val.dim() != 2 or t_val.shape[1] != g_val.shape[-1]:
        return None
    if g_val.dtype not in (torch.bfloat16, torch.float16) or not g_val.is_contiguous():  # the op writes g row-major
        return None
    match = producers.fused(producer)
    return None if match is None else (producer, *match)


def layer_norm_match(t: fx.Node) -> fx.Node | None:
    """The norm's ``getitem(native_layer_norm(...), 0)`` ``t`` is a flattening view of, where
    ``fused_layer_norm`` applies (normalized over the last dim, in half precision)."""
    y = _unflattened(t)
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
    if any(v is not None and (not isinstance(v, fx.Node) or tuple(v.meta["val"].shape) != (N,)) for v in (weight, bias)):
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


def fused_column_sums(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """If a bias gradient sums ``t``'s columns, ``t``'s rowwise cast and those sums in one
    read of ``t`` (``fsg::rowwise_fp8``)."""
    val = t.meta["val"]
    if val.dim() != 2 or not val.is_contiguous() or not column_sums(t):
        return
    base = rows_base(t)
    column_amax = FUSE_COLUMN_AMAX and base in q.flipped
    with q.graph.inserting_before(t.next):
        out = outputs(q, q.call(ROWWISE_FP8, (t, column_amax)))
    q.casts[(t, False, dtype)], q.scales[(t, False, dtype)] = out["q"], out["inv"]
    read_column_sums(q, t, out["colsum"])
    if column_amax:
        q.column_amax[base] = out["colamax"]


def outputs(q: Any, fused: fx.Node) -> dict[str, fx.Node]:
    """A fused op's outputs by name (``OUTPUTS``)."""
    return {name: q.item(fused, i) for i, name in enumerate(OUTPUTS[fused.target])}


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
