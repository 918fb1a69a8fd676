"""The producers whose kernel a rowwise FP8 cast is computed in (``passes/float8/fuse.py``), and
each one's fused op with its arguments: a GELU and its gradient, a concatenation of row
pieces (``kernels/fp8/cast.py``), and a gated MLP's products and gradients
(``kernels/fp8/gated.py``).

A producer matches only where the fused kernel computes exactly what the graph does: inputs of
the producer's shape, row-major (or, for a gated product, strided rows sharing their strides),
in one dtype.
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src.kernels.fp8 import cast as float8_cast  # noqa: F401 - registers the fused ops
from fsg._src.kernels.fp8 import gated as gated_fp8  # noqa: F401 - registers the fused ops
from fsg._src.passes.patterns import CAT, GELU, GELU_BACKWARD, MUL, SILU, SILU_BACKWARD

aten, fsg_ops = torch.ops.aten, torch.ops.fsg
GELU_BACKWARD_FP8, GELU_FP8, CAT_FP8 = (
    fsg_ops.gelu_backward_fp8.default,
    fsg_ops.gelu_fp8.default,
    fsg_ops.cat_rowwise_fp8.default,
)
GATED_FP8, GATED_BACKWARD_FP8 = fsg_ops.gated_fp8.default, fsg_ops.gated_backward_fp8.default
# the ops a cast is fused into: a GELU's gradient (with its dy's product where it is one: a
# gated GELU's), a GELU, a concatenation, a gated MLP's product act(x) * h, a SiLU's gradient
PRODUCERS = frozenset({GELU_BACKWARD, GELU, CAT, MUL, SILU_BACKWARD})
# the fused ops that take a ``column_sums`` flag (the others always return their column sums, or none)
TAKES_COLUMN_SUMS = frozenset({GATED_FP8, GATED_BACKWARD_FP8})
# the producer's inputs the fused op computes itself: erased once nothing else reads them
ABSORBED = frozenset({SILU, GELU, MUL})
_GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


def fused(producer: fx.Node) -> tuple[object, tuple] | None:
    """The fused op for ``producer`` (in ``PRODUCERS``) and its arguments (the column-sum flag,
    where the op takes one, and the column-amax flag follow), or ``None`` where the kernels do
    not cover it."""
    if producer.target is GELU_BACKWARD:
        args = gelu_backward_args(producer)
        if args is None:
            return None
        factors = _sole_product(args[0])
        if factors is not None:  # a gated GELU's gate gradient: gelu_backward(dy * y, h)
            return GATED_BACKWARD_FP8, (factors[0], args[1], factors[1], _GELU_ACTIVATIONS[args[2]])
        return GELU_BACKWARD_FP8, args
    if producer.target is GELU:
        h, approximate = producer.args[0], _approximate(producer, 1)
        if not isinstance(h, fx.Node) or approximate not in float8_cast.APPROXIMATIONS:
            return None
        return (GELU_FP8, (h, approximate)) if h.meta["val"].is_contiguous() else None
    if producer.target is MUL:
        args = gated_args(producer)
        return None if args is None else (GATED_FP8, args)
    if producer.target is SILU_BACKWARD:
        if len(producer.args) != 2 or not _rows_like(producer, *producer.args):
            return None
        dy, h = producer.args
        dy, y = _sole_product(dy) or (dy, None)
        return GATED_BACKWARD_FP8, (dy, h, y, "silu")
    args = cat_args(producer)
    return None if args is None else (CAT_FP8, args)


def _approximate(node: fx.Node, i: int) -> str:
    return node.kwargs.get("approximate", node.args[i] if len(node.args) > i else "none")


def gelu_backward_args(node: fx.Node) -> tuple | None:
    """``(dy, h, approximate)`` of ``gelu_backward(dy, h)`` where the kernels cover it."""
    dy, h = node.args[:2]
    approximate = _approximate(node, 2)
    if approximate not in float8_cast.APPROXIMATIONS or not _rows_like(node, dy, h):
        return None
    return (dy, h, approximate)


def cat_args(node: fx.Node) -> tuple | None:
    """``(pieces,)`` of a concatenation of 2 or 3 equal row pieces along the last dim."""
    shape = node.meta["val"].shape
    pieces, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if dim % len(shape) != len(shape) - 1 or not 2 <= len(pieces) <= 3:
        return None
    vals = [p.meta["val"] if isinstance(p, fx.Node) else None for p in pieces]
    if any(v is None or v.shape != vals[0].shape or v.dtype != vals[0].dtype or v.stride(-1) != 1 for v in vals):
        return None
    return (list(pieces),)


def gated_args(mul: fx.Node) -> tuple | None:
    """``(x, h, activation)`` where ``mul`` is ``act(x) * h`` or ``h * act(x)``, ``act`` a SiLU
    or a GELU (``gated_fp8``)."""
    if len(mul.args) != 2 or mul.kwargs:
        return None
    for act, h in (mul.args, mul.args[::-1]):
        activation = _activation(act)
        if activation is not None and _rows_like(mul, act) and _rows_like(mul, act.args[0], h, views=True):
            return (act.args[0], h, activation)
    return None


def _activation(node: object) -> str | None:
    """The ``gated_fp8`` activation ``node`` computes, if it is a SiLU or GELU of one tensor."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is SILU and not node.kwargs and len(node.args) == 1:
        return "silu"
    if node.target is GELU and set(node.kwargs) <= {"approximate"} and len(node.args) <= 2:
        return _GELU_ACTIVATIONS.get(_approximate(node, 1))
    return None


def _sole_product(dy: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` where ``dy`` is ``a * b`` of row-major tensors of its shape that nothing but
    its one reader reads (the fused op computes it then)."""
    if not (dy.op == "call_function" and dy.target is MUL and not dy.kwargs and len(dy.users) == 1):
        return None
    return tuple(dy.args) if len(dy.args) == 2 and _rows_like(dy, *dy.args) else None


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
