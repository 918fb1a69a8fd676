"""Views as reshapes before Inductor: a workaround for views recorded on eager strides.

Inductor traces fsg's aten graph once more (AOTAutograd under its own decompositions), and a
decomposed op can return other strides than the eager kernel stage 1 traced: Bloom's
``baddbmm`` and T5's attention backward come back transposed, and an ``aten.view`` recorded
on the eager strides then fails to compile ("Cannot view a tensor with shape ... and strides
..."), while the same step runs under ``aot_eager``. ``reshape`` is that view where the
strides allow it and a copy where they do not: the same values. Stage 1's graphs are
functional (every write an epilogue ``copy_`` into a state input, no read after it), so a
view no op writes through can become a reshape; stage 4 rewrites those before Inductor.
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src import graph_facts

_aten = torch.ops.aten


def views_as_reshapes(gm: fx.GraphModule) -> int:
    """Rewrites ``gm``'s ``aten.view`` nodes that no op writes through as ``aten.reshape`` (in
    place); returns how many."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _aten.view.default:
            continue
        if any(graph_facts.writes(user) for user in node.users):
            continue
        node.target = _aten.reshape.default
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
