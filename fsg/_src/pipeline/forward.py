"""The forward and loss of one microbatch, traced into one aten graph for splitting.

Inputs: the param leaves, then the batch leaves of one microbatch, then the step's key
``state.rng`` and the microbatch's key offset (``random.call_offset``); output: ``(loss, *aux)``
(aux sorted by name). Random ops (dropout) are traced keyed (``trace/random.py``), so that
microbatch ``j``'s stages draw what the unsharded step draws for it. Nodes carry their module's name (``modules.recording``). The graph is
functionalized, so that no stage writes a value another stage made.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import fx

from fsg._src import _torch_private, tree
from fsg._src.pipeline import modules
from fsg._src.trace import loss_output, purity, random


class Forward(NamedTuple):
    graph: fx.GraphModule
    aux_names: tuple[str, ...]
    random_calls: int  # the keyed random calls of one microbatch


def trace_forward(
    loss_fn: Callable[..., Any], params: dict[str, torch.Tensor], microbatch: Any, decompositions: Any = None
) -> Forward:
    """``loss_fn(params, microbatch)`` as a graph of the flat params, batch leaves and keys;
    ``decompositions``: a table (on a data mesh, the ops stage 2 has verified rules for:
    ``op_support.mesh_decompositions``)."""
    names = list(params)
    batch_leaves, batch_def = tree.flatten(microbatch)
    aux_names: list[str] = []
    calls = [0]
    n_p, n_b = len(names), len(batch_leaves)

    def forward(*flat):
        rng, offset = flat[n_p + n_b :]
        with torch.enable_grad(), random.keyed(rng, offset) as keys:
            batch = tree.unflatten(batch_def, flat[n_p : n_p + n_b])
            loss, aux = loss_output.call_loss(loss_fn, dict(zip(names, flat[:n_p])), batch, None)
        calls[0] = keys.calls
        aux_names[:] = sorted(aux)
        return (loss, *(aux[k] for k in aux_names))

    # inputs that require grad, not a detach() in the graph: a stage differentiates through it
    leaves = [p.detach().requires_grad_(p.is_floating_point()) for p in params.values()]
    device = leaves[0].device if leaves else batch_leaves[0].device
    keys = keys_like(device)
    with modules.recording():
        gm = purity.trace(forward, *leaves, *batch_leaves, *keys, source_lines=False, decompositions=decompositions)
        gm = _torch_private.functionalize(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return Forward(gm, tuple(aux_names), calls[0])


def keys_like(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the two key inputs: ``state.rng`` and a microbatch's offset."""
    return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)
