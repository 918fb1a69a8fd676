"""Stage 3 graph pass: a bias gradient summed in the kernel that produces what it sums.

A linear layer's bias gradient is ``sum(g, [0])`` over the rows of its output's gradient
``g``. Inductor writes ``g`` in one kernel and sums it in another, which reads ``g`` again.
Where ``g`` is a GELU gradient (an MLP's up-projection) or a concatenation along the rows (a
fused qkv projection's gradient) in bf16 or fp16, ``fuse_bias_grads`` replaces the producer
by one op of ``kernels/bias_grad.py`` that writes ``g`` and its float32 column sums in the same
visit; each ``sum(g, [0])`` reads those sums, cast to its own dtype (as Inductor rounds its
float32 accumulation). One device, CUDA (or the Triton interpreter in the CPU tests); under
``Float8`` the float8 pass fuses these producers with their casts first and this pass finds
them gone.

The pass is off (``ENABLED``): on the H200 the fused kernel, as tiled now, is slower than
Inductor's two kernels (below). It stays for the A/B and for tuning the tiling.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.kernels import bias_grad  # noqa: F401 - registers the fused ops
from fsg._src.kernels._common import fused_ops_enabled, use_triton
from fsg._src.passes import float8_fuse, float8_producers

aten = torch.ops.aten
_FLATTENS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
GELU_BACKWARD, CAT = float8_fuse.GELU_BACKWARD, float8_fuse.CAT
GELU_BACKWARD_COLSUM = torch.ops.fsg.gelu_backward_colsum.default
CAT_COLSUM = torch.ops.fsg.cat_colsum.default
# Off by default: measured slower. GPT-2 124M on an H200 (2026-12-03, benchmarks/gpt.py's
# fsg-biasfuse against fsg in one run, RESULTS.md): the 24 fused kernels took ~91 us each and
# their partial rows' sums 0.21 ms a step, 2.40 ms in all against Inductor's 2.05 ms for the
# same producers and sums (step 31.93 against 31.80 ms). The pipeline runs the pass when it is on.
ENABLED = False


def fuse_bias_grads(gm: fx.GraphModule) -> int:
    """Rewrites each GELU gradient and row concatenation of ``gm`` whose rows a bias gradient
    sums (see the module docstring). Returns how many producers it fused."""
    if not fused_ops_enabled():
        return 0
    mode, fused = _torch_private.fake_mode(), 0
    for node in list(gm.graph.nodes):
        args = _fused_args(node)
        if args is None:
            continue
        sums = [s for rows in _row_views(node) for s in _column_sums(rows)]
        if not sums:
            continue
        target = GELU_BACKWARD_COLSUM if node.target is GELU_BACKWARD else CAT_COLSUM
        with gm.graph.inserting_before(node):
            op = gm.graph.call_function(target, args)
            op.meta["val"] = _torch_private.fake_result(mode, target, args)
            g, colsum = (gm.graph.call_function(operator.getitem, (op, i)) for i in (0, 1))
            g.meta["val"], colsum.meta["val"] = op.meta["val"]
        node.replace_all_uses_with(g)
        gm.graph.erase_node(node)
        for user in sums:
            with gm.graph.inserting_before(user):
                out = gm.graph.call_function(aten._to_copy.default, (colsum,), {"dtype": user.meta["val"].dtype})
                out.meta["val"] = user.meta["val"].reshape(-1)
                if user.meta["val"].dim() == 2:  # keepdim
                    out = gm.graph.call_function(aten.view.default, (out, list(user.meta["val"].shape)))
                    out.meta["val"] = user.meta["val"]
            user.replace_all_uses_with(out)
            gm.graph.erase_node(user)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _fused_args(node: fx.Node) -> tuple | None:
    """The fused op's arguments for ``node`` (those of the float8 pass's fused producers), or
    ``None`` where the kernel does not cover it: a GELU gradient or a concatenation of row
    pieces with 16-bit contiguous ``[..., N]`` results, on a device the kernel runs on."""
    if node.op != "call_function" or node.target not in (GELU_BACKWARD, CAT):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.dtype not in (torch.bfloat16, torch.float16):
        return None
    if not val.is_contiguous() or not val.numel() or not use_triton(val):
        return None
    args = (float8_producers.gelu_backward_args if node.target is GELU_BACKWARD else float8_producers.cat_args)(node)
    inputs = args[:2] if node.target is GELU_BACKWARD else args[0] if args else ()
    return args if args and all(x.meta["val"].dtype == val.dtype for x in inputs) else None


def _row_views(node: fx.Node) -> list[fx.Node]:
    """``node`` and its 2-D views that keep its row width (``[M, N]``: what a bias gradient sums)."""
    width = node.meta["val"].shape[-1]
    views = [u for u in node.users if u.op == "call_function" and u.target in _FLATTENS]
    return [node] + [v for v in views if v.meta["val"].dim() == 2 and v.meta["val"].shape[-1] == width]


def _column_sums(rows: fx.Node) -> list[fx.Node]:
    """The users of ``rows`` (2-D) that sum its columns in its own dtype: ``sum(rows, [0])``."""
    return float8_fuse.column_sums(rows) if rows.meta["val"].dim() == 2 else []
