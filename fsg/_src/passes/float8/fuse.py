"""Where the float8 pass computes a rowwise cast in one kernel with what surrounds it
(``kernels/fp8/cast.py``'s ops), instead of leaving each cast to Inductor as its own
reductions over the tensor. Each fusion is a field of the step's ``Fusions``
(``passes/options.py``), on by default:

- A rowwise operand whose producer is in ``fp8_producers`` (a GELU gradient, a GELU, a
  concatenation of row pieces, a gated MLP's ``act(x) * h`` and its gate's gradient:
  ``passes/float8/producers.py``): the producer, its cast and, where a bias gradient sums the
  tensor, its column sums become one op.
- A rowwise operand a layer norm produces (``fp8_layer_norms``): the norm and the cast of its
  output become one op (``fsg::layer_norm_fp8``, ``passes/float8/norms.py``), which returns the
  norm's statistics too; with ``fp8_residual_adds`` the residual add it normalizes
  (``LN(x + r)``, ``fsg::add_layer_norm_fp8``, which writes the sum too).
- Any other rowwise operand a bias gradient sums (the residual stream's gradient,
  ``fp8_column_sums``): its cast and column sums become one op (``fsg::rowwise_fp8``).
- A weight both the forward and the grad-input read in FP8 (``fp8_weights``): its two casts,
  of ``W`` and of ``W.T``, become one op reading its float32 master (``fsg::weight_fp8``,
  ``passes/float8/weights.py``).

The fused ops can also return a tensor's column maxima; the pass never asks for them (computed
in the kernel they measured slower than Inductor's reductions: benchmarks/RESULTS.md). Each
result equals the unfused graph's bit for bit in its maxima and to rounding in its sums
(``tests/test_float8.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsg._src.kernels.fp8 import cast as float8_cast
from fsg._src.passes.float8 import norms as norms
from fsg._src.passes.float8 import producers as producers
from fsg._src.passes.float8 import weights as weights
from fsg._src.passes.float8.graph import column_sums, fused_outputs, read_column_sums, unflattened
from fsg._src.passes.options import Fusions
from fsg._src.passes.patterns import FLATTENS

aten = torch.ops.aten
ROWWISE_FP8 = torch.ops.fsg.rowwise_fp8.default
# what each op returns, by name (g: the producer's output; colamax: [0], never asked for)
OUTPUTS = {
    producers.GELU_BACKWARD_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GELU_FP8: ("g", "q", "inv", "colamax"),
    producers.CAT_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GATED_FP8: ("g", "q", "inv", "colsum", "colamax"),
    producers.GATED_BACKWARD_FP8: ("g", "q", "inv", "colsum", "colamax"),
    ROWWISE_FP8: ("q", "inv", "colsum", "colamax"),
}
# ``Fusions.fp8_producers``' names of the producers' ops
PRODUCER_OPS = {
    "gelu_backward": producers.GELU_BACKWARD,
    "gelu": producers.GELU,
    "cat": producers.CAT,
    "mul": producers.MUL,
    "silu_backward": producers.SILU_BACKWARD,
}
assert frozenset(PRODUCER_OPS.values()) == producers.PRODUCERS


def rows_base(t: fx.Node) -> fx.Node:
    """The tensor whose rows ``t``'s are: up through the flattening views that keep the row
    width, as far as the tensor viewed is contiguous (so row ``i`` of each is the same
    memory): a matmul reading any of them transposed reads this tensor's transpose."""
    while t.op == "call_function" and t.target in FLATTENS and isinstance(src := t.args[0], fx.Node):
        val, src_val = t.meta["val"], src.meta["val"]
        if src_val.dim() < 1 or src_val.shape[-1] != val.shape[-1] or not src_val.is_contiguous():
            break
        t = src
    return t


def fuse(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """Computes ``t``'s row-major rowwise cast (``q.casts[(t, False, dtype)]``) in a fused op
    where one of ``q.fusions`` applies; leaves it unset otherwise (the generic cast follows)."""
    fusions: Fusions = q.fusions
    if dtype != float8_cast.E4M3:
        return
    if fusions.fp8_layer_norms:
        norms.fused_layer_norm(q, t, dtype, fusions.fp8_residual_adds)
    if (t, False, dtype) not in q.casts:
        fused_producer(q, t, dtype)
    if (t, False, dtype) not in q.casts and fusions.fp8_column_sums:
        fused_column_sums(q, t, dtype)
    if (t, False, dtype) not in q.casts and fusions.fp8_weights:
        weights.fused_weight(q, t, dtype)


def fused_producer(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """If ``t`` (its rows flattened to 2-D) is the output of an op a kernel fuses with the cast
    (``q.fusions.fp8_producers``: a GELU gradient, a GELU, a concatenation along the rows, a gated
    MLP's product or gradient; ``passes/float8/producers.py``), computes it, its rowwise FP8
    copy and, where a bias gradient sums it, its column sums in one kernel: the op becomes the
    fused op, whose copy and inverse scales are ``t``'s cast, and each ``sum(t, [0])`` reads
    the fused column sums."""
    match = producer_match(t, q.fusions)
    if match is None:
        return
    producer, op, args = match
    sums = (bool(column_sums(t)),) if op in producers.TAKES_COLUMN_SUMS else ()
    inputs = producer.all_input_nodes
    with q.graph.inserting_before(producer.next):
        fused = q.call(op, (*args, *sums, False))  # (no column maxima)
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


def fusable(t: fx.Node, dtype: torch.dtype, fusions: Fusions) -> str | None:
    """What ``fuse`` would compute ``t``'s row-major rowwise cast in under ``fusions``
    (``"layer norm"``, a producer's op name, ``"column sums"``), or ``None`` for the generic
    cast: the graph is not changed (``passes/float8/cost.py`` prices a fused cast by the bytes
    it adds)."""
    if dtype != float8_cast.E4M3:
        return None
    if fusions.fp8_layer_norms and norms.layer_norm_match(t) is not None:
        return "layer norm"
    if (match := producer_match(t, fusions)) is not None:
        return str(match[0].target)
    val = t.meta["val"]
    if fusions.fp8_column_sums and val.dim() == 2 and val.is_contiguous() and column_sums(t):
        return "column sums"
    return None


def producer_match(t: fx.Node, fusions: Fusions) -> tuple[fx.Node, Any, tuple] | None:
    """``t``'s producer (through flattening views), its fused op and the op's arguments, where
    ``fused_producer`` applies (the producer named in ``fusions.fp8_producers``)."""
    producer = unflattened(t)
    if producer.op != "call_function" or producer.target not in {PRODUCER_OPS[n] for n in fusions.fp8_producers}:
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
    with q.graph.inserting_before(t.next):
        out = outputs(q, q.call(ROWWISE_FP8, (t, False)))  # (no column maxima)
    q.casts[(t, False, dtype)], q.scales[(t, False, dtype)] = out["q"], out["inv"]
    read_column_sums(q, t, out["colsum"])


def outputs(q: Any, fused: fx.Node) -> dict[str, fx.Node]:
    """A fused op's outputs by name (``OUTPUTS``)."""
    return fused_outputs(q, fused, OUTPUTS)
