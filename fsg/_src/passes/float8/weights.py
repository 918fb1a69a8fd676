"""The float8 pass's fusion of a weight's two rowwise casts (``Fusions.fp8_weights``).

Under rowwise scaling a linear layer's forward reads its weight ``W`` cast a scale per row, and
its grad-input reads ``W.T`` cast a scale per row of ``W.T``. Unfused, each is the generic cast
of ``W``'s compute-dtype copy (a row reduction and a cast, then in the backward a column
reduction and a transposed cast), and that copy is written at the step's start and kept until
the backward. Where both casts are needed and ``W`` is a weight (a step input, cast to the
compute dtype or not, or a collective's result: FSDP's gathered weight), one
``fsg::weight_fp8`` (``kernels/fp8/weight.py``) computes both from what ``W`` is a cast of,
rounding as that cast does: the same values (bit for bit on CPU, where the op runs the unfused
casts; on a GPU its scales come from Triton's float32 division, as Inductor's do), and the
compute-dtype copy is no longer written where nothing else reads it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.kernels.fp8 import weight as kernel
from fsg._src.passes.batch_casts import same_tensor
from fsg._src.passes.float8.graph import fused_outputs

aten = torch.ops.aten
WEIGHT_FP8 = torch.ops.fsg.weight_fp8.default
OUTPUTS = {WEIGHT_FP8: ("q", "inv", "qt", "inv_t")}


def _through_aliases(node: fx.Node) -> fx.Node:
    """Up through detaches, aliases and views to the same shape (``batch_casts.same_tensor``:
    how stage 2 hands a rank its local tensor on a mesh)."""
    while node.op == "call_function" and same_tensor(node):
        node = node.args[0]
    return node


def source(t: fx.Node) -> tuple[fx.Node, torch.dtype | None] | None:
    """What ``fsg::weight_fp8`` reads for weight ``t`` and what it rounds that to: the float32
    step input ``t`` is a plain cast of (``(input, t's dtype)``, the input as the cast reads it),
    or ``t`` itself (``(t, None)``) where ``t`` is a step input or a collective's result;
    ``None`` where ``t`` is not a 2-D weight the kernel reads."""
    val = t.meta.get("val")
    if val is None or val.dim() != 2 or val.dtype not in kernel.SOURCES:
        return None
    if t.op == "call_function" and t.target is aten._to_copy.default and len(t.args) == 1:
        src, src_val = t.args[0], t.args[0].meta.get("val")
        if (set(t.kwargs) == {"dtype"} and t.kwargs["dtype"] in kernel.ROUNDS
                and _through_aliases(src).op == "placeholder" and src_val is not None
                and src_val.dtype == torch.float32 and src_val.shape == val.shape and src_val.device == val.device):  # fmt: skip
            return src, t.kwargs["dtype"]
        return None
    base = _through_aliases(t)
    if base.op == "placeholder" or (base.op == "call_function" and base.target is _torch_private.WAIT_TENSOR):
        return t, None
    return None


def fused_weight(q: Any, t: fx.Node, dtype: torch.dtype) -> None:
    """If ``t`` is a weight whose transpose an FP8 matmul reads too (``q.flipped``), both of
    its rowwise casts (``q.casts[(t, False, dtype)]`` and ``[(t, True, dtype)]``) from one
    ``fsg::weight_fp8``, inserted where the first is needed (before the forward matmul)."""
    if t not in q.flipped or (t, True, dtype) in q.casts or (found := source(t)) is None:
        return
    out = fused_outputs(q, q.call(WEIGHT_FP8, found), OUTPUTS)
    for flip, (cast, inv) in ((False, ("q", "inv")), (True, ("qt", "inv_t"))):
        q.casts[(t, flip, dtype)], q.scales[(t, flip, dtype)] = out[cast], out[inv]
