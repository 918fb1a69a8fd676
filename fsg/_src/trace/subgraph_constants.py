"""Stage 1: tensor constants inside a higher-order operator's subgraphs (a FlexAttention
``mask_mod`` or ``score_mod``) become ops that make them, where they are scalars.

A ``mask_mod`` that indexes a captured tensor with a Python int (``lengths[0]``), or makes a
tensor (``torch.tensor(100)``), traces the index or the tensor as a constant of the subgraph:
FlexAttention evaluates its mods under ``TransformGetItemToIndex``, which turns every index
into a tensor. Inductor traces each subgraph again with functionalization, and there a
constant read by ``lift_fresh_copy`` fails inside torch ("Attempting to use FunctionalTensor
on its own", torch 2.11 and 2.13), whether the mask was built inside the step or outside it.
A scalar constant becomes ``aten.scalar_tensor`` of its value, dtype and device, which the
trace makes afresh; ``constants_left`` names what stays (a constant with elements), which the
Inductor backend refuses by name (``backend/flex_attention.py``); the eager and ``aot_eager``
backends run either.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten
_LIFT, _DETACH_ = aten.lift_fresh_copy.default, aten.detach_.default


def _subgraphs(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """The graph modules nested in ``gm`` (each a higher-order operator's subgraph), by name."""
    return [(name, sub) for name, sub in gm.named_modules() if sub is not gm and isinstance(sub, fx.GraphModule)]


def _constant(sub: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The tensor ``node`` (``lift_fresh_copy`` of a ``get_attr``) copies, or ``None``."""
    if node.op != "call_function" or node.target is not _LIFT or node.args[0].op != "get_attr":
        return None
    value = getattr(sub, node.args[0].target, None)
    return value if isinstance(value, torch.Tensor) else None


def inline_scalar_constants(gm: fx.GraphModule) -> int:
    """Each scalar tensor constant a subgraph of ``gm`` copies becomes ``aten.scalar_tensor`` of
    its value (the in-place ``detach_`` of the copy, a no-op, dropped); returns how many."""
    done = 0
    for _, sub in _subgraphs(gm):
        changed = False
        for node in list(sub.graph.nodes):
            value = _constant(sub, node)
            if value is None or value.dim() != 0:
                continue
            with sub.graph.inserting_before(node):
                kwargs = {"dtype": value.dtype, "device": value.device}
                made = sub.graph.call_function(aten.scalar_tensor.default, (value.item(),), kwargs)
            made.meta = dict(node.meta)
            for user in list(node.users):
                if user.target is _DETACH_:  # detach_ returns its input: its readers read the scalar
                    user.replace_all_uses_with(made)
                    sub.graph.erase_node(user)
            node.replace_all_uses_with(made)
            sub.graph.erase_node(node)
            done, changed = done + 1, True
        if changed:
            sub.graph.eliminate_dead_code()  # the constants' get_attr nodes
            sub.recompile()
    return done


def constants_left(gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """The tensor constants with elements that ``gm``'s subgraphs still copy, with each
    subgraph's name."""
    return [
        (name, value)
        for name, sub in _subgraphs(gm)
        for node in sub.graph.nodes
        if (value := _constant(sub, node)) is not None
    ]
