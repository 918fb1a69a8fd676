"""The forward and loss of one microbatch, traced into one aten graph for splitting.

Inputs: the param leaves, then the batch leaves of one microbatch; output: ``(loss, *aux)``
(aux sorted by name). Nodes carry their module's name (``modules.recording``). The graph is
functionalized, so that no stage writes a value another stage made.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

from fsg._src import _torch_private, tree
from fsg._src.errors import UnsupportedError
from fsg._src.pipeline import modules
from fsg._src.trace import loss_output, purity


def trace_forward(
    loss_fn: Callable[..., Any], params: dict[str, torch.Tensor], microbatch: Any, decompositions: Any = None
) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """``loss_fn(params, microbatch)`` as a graph of the flat params and batch leaves, and the
    aux metrics' names; ``decompositions``: a table (on a data mesh, the ops stage 2 has
    verified rules for: ``op_support.mesh_decompositions``)."""
    names = list(params)
    batch_leaves, batch_def = tree.flatten(microbatch)
    aux_names: list[str] = []

    def forward(*flat):
        with torch.enable_grad():
            batch = tree.unflatten(batch_def, flat[len(names) :])
            loss, aux = loss_output.call_loss(loss_fn, dict(zip(names, flat[: len(names)])), batch, None)
        aux_names[:] = sorted(aux)
        return (loss, *(aux[k] for k in aux_names))

    # inputs that require grad, not a detach() in the graph: a stage differentiates through it
    leaves = [p.detach().requires_grad_(p.is_floating_point()) for p in params.values()]
    with modules.recording():
        gm = purity.trace(forward, *leaves, *batch_leaves, source_lines=False, decompositions=decompositions)
        gm = _torch_private.functionalize(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and _draws(node):
            raise UnsupportedError(
                f"loss_fn draws random numbers ({_torch_private.op_name(node.target)}, e.g. dropout); a pipeline "
                f"step does not carry the step's random key across stages yet. Turn dropout off (p=0) for now"
            )
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, tuple(aux_names)


def _draws(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: an attention's only with a nonzero ``dropout_p``."""
    if not _torch_private.draws_random(node.target):
        return False
    names = _torch_private.arg_names(node.target)
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else 0.0)
    return p != 0.0
