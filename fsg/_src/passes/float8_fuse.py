"""Where the float8 pass computes a rowwise cast in one kernel with what surrounds it
(``kernels/float8_cast.py``'s ops), instead of leaving each cast to Inductor as its own
reductions over the tensor.

- A rowwise operand whose producer is in ``FUSED_PRODUCERS`` (a GELU gradient, a GELU, a
  concatenation of row pieces, a gated MLP's ``act(x) * h`` and its gate's gradient:
  ``passes/float8_producers.py``): the producer, its cast and, where a bias gradient sums the
  tensor, its column sums become one op.
- A rowwise operand a layer norm produces (with ``FUSE_LAYER_NORMS``): the norm and the cast
  of its output become one op (``fsg::layer_norm_fp8``), which returns the norm's statistics too.
- A rowwise operand a layer norm's backward produces, plus the residual stream's gradient (with
  ``FUSE_NORM_BACKWARDS``): the backward, the add, the cast and the column sums become one op
  (``fsg::layer_norm_backward_fp8``). Both: ``passes/float8_norms.py``.
- Any other rowwise operand a bias gradient sums (the residual stream's gradient): its cast
  and column sums become one op (``fsg::rowwise_fp8``).
- A weight both the forward and the grad-input read in FP8 (with ``FUSE_WEIGHTS``): its two
  casts, of ``W`` and of ``W.T``, become one op reading its float32 master
  (``fsg::weight_fp8``, ``passes/float8_weights.py``).
- With ``FUSE_COLUMN_AMAX`` (off: measured slower, below), either op also returns the
  tensor's column maxima of ``|t|`` where a grad-weight matmul reads ``t`` transposed in FP8
  (``Float8(grad_weight="fp8")``): the transposed cast's scales, so that cast needs no column
  reduction of its own.

Each result equals the unfused graph's bit for bit in its maxima and to rounding in its sums
(``tests/test_float8.py``). The flags below turn each fusion off (``benchmarks/gpt.py``'s A/B
implementations; the tests compare fused and unfused steps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsg._src.kernels import float8_cast
from fsg._src.passes import float8_norms as norms
from fsg._src.passes import float8_producers as producers
from fsg._src.passes import float8_weights as weights
from fsg._src.passes.float8_graph import FLATTENS, column_sums, fused_outputs, read_column_sums, unflattened

aten = torch.ops.aten
GELU, GELU_BACKWARD, CAT = producers.GELU, producers.GELU_BACKWARD, producers.CAT
ROWWISE_FP8 = torch.ops.fsg.rowwise_fp8.default
# what each op returns, by name (g: the producer's output; colamax: [0] unless asked)
OUTPUTS = {
    producers.GELU_BACKWARD_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GELU_FP8: ("g", "q", "inv", "colamax"),
    producers.CAT_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GATED_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GATED_BACKWARD_FP8: ("g", "q", "inv", "colsum", "colamax"),
    ROWWISE_FP8: ("q", "inv", "colsum", "colamax"),
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
# a rowwise operand a layer norm's backward writes (plus the residual stream's gradient): the
# backward, the add, the cast and the column sums in one kernel instead of Inductor's backward
# then ``fsg::rowwise_fp8``'s second read (GPT's proj and fc2 output gradients). Off: measured
# 7.3 ms slower at GPT-2 355M on an H100 (2026-12-07, RESULTS.md: its kernel 256 us a norm with
# 2-4-row tiles; one row a tile since, not yet measured); its op returns no column maxima
FUSE_NORM_BACKWARDS = False
# any other rowwise operand with a bias gradient: its cast and column sums (H200, RESULTS.md: 75.43
# against 76.04 ms at GPT-2 355M, 202.04 against 204.67 ms at 1.3B with FP8 grad-weights)
FUSE_COLUMN_SUMS = True
# the column maxima of a fused op's tensor that a grad-weight reads transposed in FP8: measured
# slower, so off (H200, 2026-12-03, fsg-fp8-row-gw against -nocolamax in one run: 80.90 against
# 79.83 ms at GPT-2 355M, 200.85 against 199.67 ms at 1.3B; the kernel's maxima, folded by
# atomic max or stored as a partial row per program, cost it more than Inductor's reductions)
FUSE_COLUMN_AMAX = False
# a weight both the forward and the grad-input read in FP8: its two casts (a scale per row of W
# and per row of W.T) in one op from its float32 master (``passes/float8_weights.py``), instead of
# the compute-dtype copy and Inductor's two reductions and casts of it. On since 2026-12-07
# (RESULTS.md): 1.62 ms off GPT-2 355M's step on an H100 (79.60 against 81.22 ms, the norm
# backwards fused in both rows) and 0.28 GiB off its peak; the GPU tests pass
FUSE_WEIGHTS = True


def rows_base(t: fx.Node) -> fx.Node:
    """The tensor whose rows ``t``'s are: up through the flattening views that keep the row
    width, as far as the tensor viewed is contiguous (so row ``i`` of each is the same
    memory). A fused op's column maxima, keyed by this tensor, serve every such view."""
    while t.op == "call_function" and t.target in FLATTENS and isinstance(src := t.args[0], fx.Node):
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
        norms.fused_layer_norm(q, t, dtype, FUSE_RESIDUAL_ADDS)
    if FUSE_NORM_BACKWARDS and (t, False, dtype) not in q.casts:
        norms.fused_norm_backward(q, t, dtype)
    if FUSE_PRODUCERS and (t, False, dtype) not in q.casts:
        fused_producer(q, t, dtype)
    if (t, False, dtype) not in q.casts and FUSE_COLUMN_SUMS:
        fused_column_sums(q, t, dtype)
    if (t, False, dtype) not in q.casts and FUSE_WEIGHTS:
        weights.fused_weight(q, t, dtype)


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


def fusable(t: fx.Node, dtype: torch.dtype) -> str | None:
    """What ``fuse`` would compute ``t``'s row-major rowwise cast in (``"layer norm"``, a
    producer's op name, ``"column sums"``), or ``None`` for the generic cast: the graph is not
    changed (``passes/float8_cost.py`` prices a fused cast by the bytes it adds)."""
    if dtype != float8_cast.E4M3:
        return None
    if FUSE_LAYER_NORMS and norms.layer_norm_match(t) is not None:
        return "layer norm"
    if FUSE_NORM_BACKWARDS and norms.norm_backward_match(t) is not None:
        return "layer norm backward"
    if FUSE_PRODUCERS and (match := producer_match(t)) is not None:
        return str(match[0].target)
    val = t.meta["val"]
    if FUSE_COLUMN_SUMS and val.dim() == 2 and val.is_contiguous() and column_sums(t):
        return "column sums"
    return None


def producer_match(t: fx.Node) -> tuple[fx.Node, Any, tuple] | None:
    """``t``'s producer (through flattening views), its fused op and the op's arguments, where
    ``fused_producer`` applies."""
    producer = unflattened(t)
    if producer.op != "call_function" or producer.target not in FUSED_PRODUCERS:
        return None
    g_val, t_val = producer.meta["val"], t.meta["val"]
    if g_val.dim() < 2 or t_val.dim() != 2 or t_val.shape[1] != g_val.shape[-1]:
        return None
    if g_val.dtype not in (torch.bfloat16, torch.float16) or not g_val.is_contiguous():  # the op writes g row-major
        return None
    match = producers.fused(producer)
    return None if match is None else (producer, *match)


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
    return fused_outputs(q, fused, OUTPUTS)
