"""Scaled adds of matrix products spelled out before Inductor: a workaround for silent
miscompiles.

Inductor's post-grad pattern that fuses an ``add`` of a matrix product into ``addmm``
(``torch/_inductor/fx_passes/post_grad.py``, ``addmm``, torch 2.13) matches
``add(mm(a, b), x)`` and ``add(x, mm(a, b))`` whatever their ``alpha``, and emits
``addmm(x, a, b)``: the scale is dropped. ``torch.compile`` of ``x.add(a @ b, alpha=0.1)``
returns ``x + a @ b``; a VQ-VAE's codebook average, ``avg.mul_(decay).add_(onehot.t() @ z,
alpha=1 - decay)``, trained wrongly under fsg's default backend. So every ``add`` with an
``alpha`` becomes ``add(x, mul(y, alpha))``: the same value (one more rounding at most), which
no pattern misreads. Its cousin on CUDA (pytorch#167313): the pattern that splits an
``addmm`` before pointwise users emitted ``inp + a @ b``, dropping ``alpha`` and ``beta``,
in releases before the fix (2.13's keeps them; which releases have it is not pinned here), so
on CUDA an ``addmm`` with either spelled out too (Muon's Newton-Schulz iteration has them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsg._src import _torch_private

_aten = torch.ops.aten


def scaled_adds_as_products(gm: fx.GraphModule, *, split_addmm: bool | None = None) -> int:
    """Rewrites ``gm``'s scaled ``aten.add.Tensor`` nodes and its ``aten.addmm`` nodes with an
    ``alpha`` or ``beta`` (``split_addmm``; default: those on CUDA) as explicit products and
    adds, in place; returns how many."""
    mode = _torch_private.fake_mode()

    def call(target: Any, args: tuple, like: fx.Node) -> fx.Node:
        new = gm.graph.call_function(target, args)
        new.meta = {**like.meta, "val": _torch_private.fake_result(mode, target, args)}
        return new

    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _aten.add.Tensor and node.kwargs.get("alpha", 1) != 1:
            x, y = node.args
            with gm.graph.inserting_before(node):
                scaled = call(_aten.mul.Tensor, (y, node.kwargs["alpha"]), node)
            node.args, node.kwargs = (x, scaled), {}
        elif node.target is _aten.addmm.default and _scaled(node, split_addmm):
            inp, a, b = node.args[:3]
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            with gm.graph.inserting_before(node):
                product = call(_aten.mm.default, (a, b), node)
                out = product if alpha == 1 else call(_aten.mul.Tensor, (product, alpha), node)
                if beta != 0:  # beta = 0: addmm ignores inp, NaN included
                    out = call(_aten.add.Tensor, (call(_aten.mul.Tensor, (inp, beta), node) if beta != 1 else inp, out), node)
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
        else:
            continue
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _scaled(node: fx.Node, split: bool | None) -> bool:
    if node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        return False
    val = node.meta.get("val")
    return split if split is not None else isinstance(val, torch.Tensor) and val.device.type == "cuda"
