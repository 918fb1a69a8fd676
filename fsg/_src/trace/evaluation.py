"""Stage 1 of an evaluation step: trace ``fn(params, batch)`` forward only, modules in eval mode.

The graph reads the state's params, buffers and key (``TrainState`` with its optimizer state
left out: see ``eval_inputs``) and the batch, and returns the metrics; it writes nothing.
``fsg.apply`` runs every module inside with ``training=False`` (dropout off, BatchNorm on its
running statistics). A module that writes a buffer even so writes a copy, which the graph
then drops, so the state is never written.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import torch
from torch import fx

from fsg._src import functional, graph_facts, tree
from fsg._src.errors import FsgError, ImpureLossError, LossNotScalarError
from fsg._src.precision import Policy
from fsg._src.trace import block_masks, markers, purity, random, subgraph_constants
from fsg._src.trace.fused_loss import FusedLoss
from fsg._src.trace.tracing import TracedStep
from fsg._src.train_state import TrainState

EvalFn = Callable[..., Any]


class TracedEval(NamedTuple):
    """Stage 1's output for an evaluation step."""

    step: TracedStep  # the graph; its outputs are the metrics, by ``step.metric_names``
    returns_tensor: bool  # fn returned one tensor (not a dict): the step returns it as is


def eval_inputs(state: TrainState) -> TrainState:
    """What an evaluation step reads of ``state``: all of it but the optimizer state."""
    return state._replace(opt_state=())


def in_eval_mode(fn: EvalFn) -> EvalFn:
    """``fn`` with every ``fsg.apply`` inside running its modules in eval mode."""

    def run(*args: Any) -> Any:
        with functional.training(False):
            return fn(*args)

    return run


def _call(fn: EvalFn, params: Any, batch: Any, buffers: Any) -> tuple[dict[str, torch.Tensor], bool]:
    out = fn(params, batch, buffers) if buffers else fn(params, batch)
    if isinstance(out, torch.Tensor):
        return {"": out}, True
    if not isinstance(out, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out.items()):
        raise LossNotScalarError(
            f"an evaluation function must return a tensor or a dict {{name: tensor}} of metrics; it "
            f"returned a {type(out).__name__}. Return e.g. {{'loss': loss, 'accuracy': accuracy}}."
        )
    return out, False


def _drop_unwritten_clones(gm: fx.GraphModule) -> None:
    """A buffer copy the graph never writes is the buffer itself: ``clone(x)`` becomes ``x``."""
    written = set().union(*(graph_facts.writes(n) for n in gm.graph.nodes))
    for node in list(gm.graph.nodes):
        is_clone = node.op == "call_function" and node.target is torch.ops.aten.clone.default
        if is_clone and node.args[0].op == "placeholder" and node not in written:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def trace_eval(
    fn: EvalFn,
    state: TrainState,
    batch: Any,
    *,
    precision: Policy = Policy(),  # noqa: B008 - an immutable NamedTuple
    mark_uses: bool = False,
    source_lines: bool = False,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
    fused_loss: bool = False,
) -> TracedEval:
    """Stage 1: traces ``fn`` on ``eval_inputs(state)`` and ``batch`` into a ``TracedEval``.

    Params are cast to the compute dtype; ``mark_uses`` marks each read of a parameter for
    stage 2 (FSDP gathers). Random ops draw from ``state.rng`` as the train step's would (a
    step's key, not advanced: evaluating twice draws the same). ``fused_loss``: as ``trace``'s.
    """
    inputs = eval_inputs(state)
    precision = precision.resolve(inputs.params)
    state_leaves, state_def = tree.flatten(inputs)
    batch_leaves, batch_def = tree.flatten(batch)
    n_state = len(state_leaves)
    found: dict[str, Any] = {}

    def flat_eval(*flat):
        s = tree.unflatten(state_def, flat[:n_state])
        leaves, params_def = tree.flatten(s.params)
        mark = markers.param_use if mark_uses else (lambda p, i: p)
        used = [mark(precision.read_param(p), i) if p.is_floating_point() else p for i, p in enumerate(leaves)]
        buffers = tree.tree_map(torch.clone, s.buffers)  # writes land in copies; unwritten ones are dropped
        fusing = FusedLoss() if fused_loss else contextlib.nullcontext()
        with functional.training(False), random.keyed(s.rng), precision.region(leaves[0].device), fusing:
            metrics, single = _call(
                fn,
                tree.unflatten(params_def, used),
                precision.cast_compute(tree.unflatten(batch_def, flat[n_state:])),
                buffers,
            )
        found.update(names=tuple(sorted(metrics)), single=single)
        return tuple(metrics[k].detach() for k in found["names"])

    def violation() -> FsgError | None:
        return purity.diagnose(in_eval_mode(fn), state.params, batch, state.buffers)

    gm = purity.trace(flat_eval, *state_leaves, *batch_leaves, source_lines=source_lines, decompositions=decompositions)
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    if purity.has_host_sync(gm) or purity.writes_to_inputs(gm, placeholders):
        raise violation() or ImpureLossError(
            "the evaluation function reads a tensor value on the host or writes to its params or "
            "batch in place; see ev.lower(state, batch).as_text('traced') for the op."
        )
    _drop_unwritten_clones(gm)
    subgraph_constants.inline_scalar_constants(gm)  # a mask_mod's lengths[0]: Inductor's retrace fails on it
    block_masks.fold(gm)  # a FlexAttention block mask built from constants: computed once
    gm.meta["num_state_leaves"] = n_state
    return TracedEval(TracedStep(gm, n_state, found["names"], donate=False), found["single"])
