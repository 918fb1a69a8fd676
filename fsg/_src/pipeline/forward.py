"""The forward and loss of one microbatch, traced into one aten graph for splitting.

Inputs: the param leaves, then the batch leaves of one microbatch, then the step's key
``state.rng`` and the microbatch's key offset (``random.call_offset``); output: ``(loss, *aux)``
(aux sorted by name). Random ops (dropout) are traced keyed (``trace/random.py``), so that
microbatch ``j``'s stages draw what the unsharded step draws for it. Nodes carry their module's
name (``modules.recording``). The graph is functionalized, so that no stage writes a value
another stage made.

As in the unsharded step (``frozen.py``), ``fsg.apply`` detaches a frozen parameter
(``requires_grad=False``) in the trace, and the trace finds which params the loss reaches
through autograd at all (``reached``): the others (frozen, unread, or read only through
non-differentiable ops) are kept as they were, optimizer state and all.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import fx

from fsg._src import _torch_private, frozen, tree, watch
from fsg._src.pipeline import modules
from fsg._src.trace import loss_output, purity, random


class Forward(NamedTuple):
    graph: fx.GraphModule
    aux_names: tuple[str, ...]
    random_calls: int  # the keyed random calls of one microbatch
    reached: frozenset[int]  # the params the loss's gradient reaches (the others are not trained)


def trace_forward(
    loss_fn: Callable[..., Any],
    params: dict[str, torch.Tensor],
    microbatch: Any,
    decompositions: Any = None,
    flags: watch.Flags | None = None,
) -> Forward:
    """``loss_fn(params, microbatch)`` as a graph of the flat params, batch leaves and keys;
    ``decompositions``: a table (on a data mesh, the ops stage 2 has verified rules for:
    ``op_support.mesh_decompositions``); ``flags`` records the modules ``fsg.apply`` runs
    (their train/eval modes and ``requires_grad`` flags: the step traces again when they change)."""
    names = list(params)
    batch_leaves, batch_def = tree.flatten(microbatch)
    aux_names: list[str] = []
    calls, reached = [0], set()
    n_p, n_b = len(names), len(batch_leaves)

    def forward(*flat):
        rng, offset = flat[n_p + n_b :]
        with torch.enable_grad(), random.keyed(rng, offset) as keys, frozen.tracking(list(flat[:n_p])):
            batch = tree.unflatten(batch_def, flat[n_p : n_p + n_b])
            loss, aux = loss_output.call_loss(loss_fn, dict(zip(names, flat[:n_p])), batch, None)
        calls[0] = keys.calls
        reached.update(reached_leaves(loss, flat[:n_p]))
        aux_names[:] = sorted(aux)
        return (loss, *(aux[k] for k in aux_names))

    # inputs that require grad, not a detach() in the graph: a stage differentiates through it
    leaves = [p.detach().requires_grad_(p.is_floating_point()) for p in params.values()]
    device = leaves[0].device if leaves else batch_leaves[0].device
    keys = keys_like(device)
    with modules.recording(), watch.recording(flags) if flags is not None else contextlib.nullcontext():
        gm = purity.trace(forward, *leaves, *batch_leaves, *keys, source_lines=False, decompositions=decompositions)
        gm = _torch_private.functionalize(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return Forward(gm, tuple(aux_names), calls[0], frozenset(reached))


def reached_leaves(loss: torch.Tensor, leaves: Sequence[torch.Tensor]) -> set[int]:
    """The indices of ``leaves`` whose gradient ``loss.backward()`` would accumulate: the leaves
    of its autograd graph (``torch.autograd.grad(loss, leaves, allow_unused=True)`` gives
    ``None`` for the others, which the unsharded step keeps untrained)."""
    index = {id(t): i for i, t in enumerate(leaves)}
    found: set[int] = set()
    todo, seen = [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None and id(variable) in index:
            found.add(index[id(variable)])
        todo.extend(f for f, _ in fn.next_functions)
    return found


def keys_like(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the two key inputs: ``state.rng`` and a microbatch's offset."""
    return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)
