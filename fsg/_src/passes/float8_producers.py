"""The producers whose kernel a rowwise FP8 cast is computed in (``passes/float8_fuse.py``), and
each one's fused op with its arguments: a GELU and its gradient, a concatenation of row
pieces (``kernels/float8_cast.py``), and a gated MLP's SiLU products (``kernels/silu_fp8.py``).

A producer matches only where the fused kernel computes exactly what the graph does: inputs of
the producer's shape, row-major, in one dtype (the kernel reads them as ``[M, N]`` rows).
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src.kernels import float8_cast, silu_fp8  # noqa: F401 - registers the fused ops

aten = torch.ops.aten
GELU, GELU_BACKWARD, CAT = aten.gelu.default, aten.gelu_backward.default, aten.cat.default
MUL, SILU, SILU_BACKWARD = aten.mul.Tensor, aten.silu.default, aten.silu_backward.default
FUSED_OPS = {
    GELU_BACKWARD: torch.ops.fsg.gelu_backward_fp8.default,
    GELU: torch.ops.fsg.gelu_fp8.default,
    CAT: torch.ops.fsg.cat_rowwise_fp8.default,
    MUL: torch.ops.fsg.silu_mul_fp8.default,  # silu(x) * h: a gated MLP's product, or its up-projection's gradient
    SILU_BACKWARD: torch.ops.fsg.silu_backward_fp8.default,  # the gate's gradient, its product's factor fused
}
# the fused ops that take a ``column_sums`` flag (the others always return their column sums, or none)
TAKES_COLUMN_SUMS = frozenset({MUL, SILU_BACKWARD})
# the producer's inputs the fused op computes itself: erased once nothing else reads them
ABSORBED = frozenset({SILU, MUL})


def fused_args(producer: fx.Node) -> tuple | None:
    """The fused op's arguments for ``producer`` (``FUSED_OPS``; the column-sum and
    column-amax flags follow), or ``None`` where the kernel does not cover it."""

    def approximate(i: int) -> str:
        return producer.kwargs.get("approximate", producer.args[i] if len(producer.args) > i else "none")

    shape = producer.meta["val"].shape
    if producer.target is GELU_BACKWARD:
        dy, h = producer.args[:2]
        if approximate(2) not in float8_cast.APPROXIMATIONS or not _rows_like(producer, dy, h):
            return None
        return (dy, h, approximate(2))
    if producer.target is GELU:
        h = producer.args[0]
        if not isinstance(h, fx.Node) or approximate(1) not in float8_cast.APPROXIMATIONS:
            return None
        return (h, approximate(1)) if h.meta["val"].is_contiguous() else None
    if producer.target is MUL:
        return silu_mul_args(producer)
    if producer.target is SILU_BACKWARD:
        return silu_backward_args(producer)
    pieces, dim = producer.args[0], producer.args[1] if len(producer.args) > 1 else producer.kwargs.get("dim", 0)
    if dim % len(shape) != len(shape) - 1 or not 2 <= len(pieces) <= 3:  # a concatenation of row pieces
        return None
    vals = [p.meta["val"] if isinstance(p, fx.Node) else None for p in pieces]
    if any(v is None or v.shape != vals[0].shape or v.dtype != vals[0].dtype or v.stride(-1) != 1 for v in vals):
        return None
    return (list(pieces),)


def _rows_like(producer: fx.Node, *inputs, views: bool = False) -> bool:
    """Whether every input is a node of ``producer``'s shape and dtype, row-major; with
    ``views``, strided views of rows are allowed too where the inputs share their strides
    (the kernel reads them in place: the halves of a fused gate-and-up projection)."""
    val = producer.meta["val"]
    if not all(isinstance(v, fx.Node) and v.meta["val"].shape == val.shape and v.meta["val"].dtype == val.dtype
               for v in inputs):  # fmt: skip
        return False
    vals = [v.meta["val"] for v in inputs]
    if views:
        return all(v.stride(-1) == 1 and v.stride() == vals[0].stride() for v in vals)
    return all(v.is_contiguous() for v in vals)


def _is(node: object, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target and not node.kwargs


def silu_mul_args(mul: fx.Node) -> tuple | None:
    """``(x, h)`` where ``mul`` is ``silu(x) * h`` or ``h * silu(x)`` (``silu_mul_fp8``)."""
    if len(mul.args) != 2:
        return None
    for silu, h in (mul.args, mul.args[::-1]):
        if _is(silu, SILU) and _rows_like(mul, silu) and _rows_like(mul, silu.args[0], h, views=True):
            return (silu.args[0], h)
    return None


def silu_backward_args(node: fx.Node) -> tuple | None:
    """``(dy, h, y)`` where ``node`` is ``silu_backward(dy * y, h)`` and nothing else reads the
    product (``silu_backward_fp8`` computes it), else ``(dy, h, None)`` for
    ``silu_backward(dy, h)``."""
    if len(node.args) != 2 or not _rows_like(node, *node.args):
        return None
    dy, h = node.args
    if _is(dy, MUL) and len(dy.users) == 1 and len(dy.args) == 2 and _rows_like(dy, *dy.args):
        return (*dy.args[:1], h, dy.args[1])
    return (dy, h, None)
