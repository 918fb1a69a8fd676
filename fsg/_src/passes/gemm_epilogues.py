"""Stage 3 graph pass: an MLP's tanh GELU and its gradient inside the GEMMs (cuBLASLt epilogues).

The joint graph of ``fc2(gelu(fc1(x), approximate="tanh"))`` holds, for the up-projection
``fc1`` (shapes: M rows, K in, N out of ``fc1``)::

    h = addmm(b, x_MK, w_t)           # [M, N], maybe viewed as [B, T, N]; mm without a bias
    a = gelu(h, approximate="tanh")
    ...
    da = mm(g, w2)                    # fc2's grad-input, [M, N]
    dh = gelu_backward(da, h, approximate="tanh")

``gemm_epilogues`` rewrites the forward pair as ``fsg::linear_gelu`` (``kernels/linear_gelu.py``:
cuBLASLt's ``GELU_AUX_BIAS`` epilogue) and the backward pair as ``fsg::mm_gelu_backward``
(``DGELU``), so no kernel of its own reads ``h`` back to write ``a``, nor ``da`` to write
``dh``; the bias gradient ``sum(dh, [0])`` stays Inductor's.
Each half applies where its pattern stands alone: a 16-bit ``addmm`` with a 1-D bias and
unit ``alpha``/``beta`` (or an ``mm``), an ``mm`` read only by the GELU gradient, dims in multiples of 8,
the tensors on CUDA (``Fusions(on_cpu={"gemm_epilogues"})`` extends it to CPU, where the ops run
the aten ops they replace: how the CPU tests check the rewrite). The rewrite is local to the graph it is given, so it
also runs on each rank's graph on a mesh (data parallel, FSDP, tensor parallel: a sharded
layer's local matmuls keep the pattern; where a collective stands between the matmul and the
GELU, the pattern is not there). It runs after the float8 pass, which takes the matmuls it
converts and their GELUs first.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.kernels import linear_gelu  # noqa: F401 - registers the ops
from fsg._src.kernels._common import fused_ops_enabled
from fsg._src.passes.options import DEFAULT, Fusions
from fsg._src.passes.patterns import FLATTENS, GELU, GELU_BACKWARD

aten = torch.ops.aten
LINEAR_GELU, MM_GELU_BACKWARD = torch.ops.fsg.linear_gelu.default, torch.ops.fsg.mm_gelu_backward.default
_DTYPES = (torch.bfloat16, torch.float16)


def gemm_epilogues(gm: fx.GraphModule, fusions: Fusions = DEFAULT) -> int:
    """Rewrites each tanh GELU fed by a bias ``addmm`` (or an ``mm``) and, with
    ``fusions.gemm_epilogue_backward``, each tanh GELU gradient fed by an ``mm`` (see the module
    docstring; on CPU where ``fusions.on_cpu`` names the pass). Returns how many GEMMs took an
    epilogue. The backward half leaves the bias gradient to Inductor: cuBLASLt's DGELU_BGRAD,
    which would sum it in the epilogue, ran as the plain GEMM plus a generic epilogue kernel,
    slower than Inductor's two kernels (benchmarks/RESULTS.md)."""
    if not fused_ops_enabled():
        return 0
    fused, rewriter = 0, _Rewriter(gm.graph, fusions)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _approximate(node) != "tanh":
            continue
        if node.target is GELU:
            fused += rewriter.forward(node)
        elif node.target is GELU_BACKWARD and fusions.gemm_epilogue_backward:
            fused += rewriter.backward(node)
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _approximate(node: fx.Node) -> str | None:
    if node.target is GELU:
        return node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    if node.target is GELU_BACKWARD:
        return node.kwargs.get("approximate", node.args[2] if len(node.args) > 2 else "none")
    return None


def _through_view(node: fx.Node, target) -> fx.Node | None:
    """``node`` itself if it is a ``target`` call, or the ``target`` call it flattens or
    unflattens (one view that keeps the last dim)."""
    if node.op == "call_function" and node.target in FLATTENS and isinstance(node.args[0], fx.Node):
        src = node.args[0]
        if src.meta["val"].shape[-1] == node.meta["val"].shape[-1]:
            node = src
    return node if node.op == "call_function" and node.target is target else None


def _eligible(fusions: Fusions, *nodes: fx.Node) -> bool:
    vals = [n.meta.get("val") for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    dtype, device = vals[0].dtype, vals[0].device
    return (
        dtype in _DTYPES
        and all(v.dtype == dtype and v.device == device for v in vals)
        and fusions.on("gemm_epilogues", device.type)
        and all(d % 8 == 0 and d > 0 for v in vals for d in v.shape[-2:])
    )


def _layout_ok(t: torch.Tensor) -> bool:
    """Row- or column-major 2-D, as cuBLASLt takes its operands (``cublaslt._operand``)."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.stride(0) == 1)


class _Rewriter:
    def __init__(self, graph: fx.Graph, fusions: Fusions):
        self.graph, self.mode, self.fusions = graph, _torch_private.fake_mode(), fusions

    def call(self, target, args: tuple) -> fx.Node:
        node = self.graph.call_function(target, args)
        node.meta["val"] = _torch_private.fake_result(self.mode, target, args)
        return node

    def outputs(self, op: fx.Node) -> tuple[fx.Node, fx.Node]:
        a, b = (self.graph.call_function(operator.getitem, (op, i)) for i in (0, 1))
        a.meta["val"], b.meta["val"] = op.meta["val"]
        return a, b

    def shaped(self, t: fx.Node, like: fx.Node) -> fx.Node:
        """``t`` viewed with ``like``'s shape (``t`` itself when they agree)."""
        shape = list(like.meta["val"].shape)
        return t if list(t.meta["val"].shape) == shape else self.call(aten.view.default, (t, shape))

    def forward(self, gelu: fx.Node) -> int:
        """``gelu(addmm(b, x, w_t))`` -> ``linear_gelu(x, w_t, b)``; ``gelu(mm(x, w_t))`` ->
        ``linear_gelu(x, w_t, None)``."""
        addmm = _through_view(gelu.args[0], aten.addmm.default) or _through_view(gelu.args[0], aten.mm.default)
        if addmm is None or addmm.kwargs or len(addmm.args) != (3 if addmm.target is aten.addmm.default else 2):
            return 0
        bias, x, w_t = addmm.args if len(addmm.args) == 3 else (None, *addmm.args)
        if not all(isinstance(n, fx.Node) for n in (x, w_t)) or not _eligible(self.fusions, x, w_t, addmm):
            return 0
        if bias is not None and (not isinstance(bias, fx.Node) or bias.meta["val"].shape != (w_t.meta["val"].shape[1],)
                                 or bias.meta["val"].dtype != x.meta["val"].dtype):  # fmt: skip
            return 0
        if not (_layout_ok(x.meta["val"]) and _layout_ok(w_t.meta["val"])):
            return 0
        with self.graph.inserting_before(addmm):
            y, h = self.outputs(self.call(LINEAR_GELU, (x, w_t, bias)))
            y = self.shaped(y, gelu)
        addmm.replace_all_uses_with(h)
        gelu.replace_all_uses_with(y)
        _erase(gelu, addmm)
        return 1

    def backward(self, gelu_backward: fx.Node) -> int:
        """``gelu_backward(mm(g, w), h)`` -> ``mm_gelu_backward(g, w, h)``."""
        grad, h = gelu_backward.args[:2]
        mm = _through_view(grad, aten.mm.default)
        if mm is None or not isinstance(h, fx.Node) or len(mm.users) != 1 or grad is not mm and len(grad.users) != 1:
            return 0
        g, w = mm.args
        if not _eligible(self.fusions, g, w, mm) or not (_layout_ok(g.meta["val"]) and _layout_ok(w.meta["val"])):
            return 0
        if h.meta["val"].dtype != mm.meta["val"].dtype or not h.meta["val"].is_contiguous():
            return 0
        with self.graph.inserting_before(gelu_backward):
            out = self.shaped(self.call(MM_GELU_BACKWARD, (g, w, h)), gelu_backward)
        gelu_backward.replace_all_uses_with(out)  # the bias gradient's sum now reads the op's dh
        _erase(gelu_backward, grad, mm)
        return 1


def _erase(*nodes: fx.Node) -> None:
    """Erases each of ``nodes`` (in order) that nothing reads any more."""
    for node in dict.fromkeys(nodes):
        if not node.users:
            node.graph.erase_node(node)
