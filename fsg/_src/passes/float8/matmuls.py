"""Stage 3 graph pass: the linear layers' matmuls as FP8 ``_scaled_mm`` (``Policy(matmul=fsg.Float8())``).

Shapes: M rows (tokens), K the contracted width, N the output width. A linear layer is three
matmuls of the joint graph: the forward ``Y_MN = X_MK @ W_NK^T`` (``mm`` or ``addmm`` reading
the weight through ``t``), the grad-input ``dX_MK = dY_MN @ W_NK`` and the grad-weight
``dW_NK = dY_MN^T @ X_MK``. The pass finds the forward matmuls (the loss's ancestors), groups
each backward matmul with the forward whose saved operand (``W`` or ``X``) it reads, and
rewrites the matmuls of each selected layer as ``aten._scaled_mm`` with scales computed in
the graph (``passes/float8/quantize.py``): tensorwise, ``scale = fp8_max / max(max|t|, eps)``
per tensor (on a mesh, each activation's and gradient's amax all-reduced over the batch's
axes), ``X`` and ``W`` in ``float8_e4m3fn``, ``dY`` in ``float8_e5m2``, all three matmuls;
or rowwise, a scale per row along the contracted dim, e4m3 throughout, the forward and the
grad-input (the grad-weight too with ``Float8(grad_weight="fp8")``: ``dY`` and ``X`` scaled
per column, along the tokens, each through a transposed copy). A matmul that cannot
or should not run in FP8 stays as it was; the ``fsg`` logger says why, at INFO one line per
reason (naming the first matmuls and how many), at DEBUG one line per matmul
(docs/precision.md#fp8).
"""

from __future__ import annotations

import logging
import operator
import re
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
from torch import fx
from torch.distributed.tensor import Replicate, Shard

from fsg._src import _torch_private, tree
from fsg._src import graph_facts as facts
from fsg._src.errors import UnsupportedError
from fsg._src.float8_config import Float8
from fsg._src.passes.float8 import cost as float8_cost
from fsg._src.passes.float8.quantize import Quantizer, flipped, fsdp_gathers, operands, peel
from fsg._src.passes.options import DEFAULT, Fusions

log = logging.getLogger("fsg")
aten = torch.ops.aten
MM, ADDMM, BMM = aten.mm.default, aten.addmm.default, aten.bmm.default
_DIM_MULTIPLE = 16  # cuBLASLt's FP8 GEMMs need every dim a multiple of 16
# What the loss may be computed from a head's output through (besides pointwise ops, views and
# reductions, read from the ops' tags and schemas): casts, softmax, the losses, and _unsafe_view
# (a reshape's copy-free result, whose schema does not say it is a view).
_LOSS_OPS = frozenset({
    "aten._unsafe_view", "aten._log_softmax", "aten._softmax", "aten.log_softmax", "aten.softmax", "aten.logsumexp", "aten._to_copy",
    "aten.nll_loss_forward", "aten.nll_loss2d_forward", "aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss",
    "aten.huber_loss", "aten.binary_cross_entropy", "aten.binary_cross_entropy_with_logits", "fsg.cross_entropy_fwd",
})  # fmt: skip


class Float8Plan(NamedTuple):
    """What the pass needs, as data: the config, the name of each parameter input (by
    placeholder position, as ``fsg.params`` spells it) and where the loss is among the outputs."""

    config: Float8
    param_names: dict[int, str]
    loss_output: int
    # tensorwise on a mesh: the process groups of the axes that shard the batch, over which
    # each activation's and gradient's amax is all-reduced (max), and the first batch input
    amax_groups: tuple[str, ...] = ()
    first_batch_input: int = 0


def plan(config: Float8 | None, state: Any, traced: Any, *, shard_plan: Any = None) -> Float8Plan | None:
    """The pass's plan for a traced step (``None`` without ``Policy(matmul=...)``); raises
    ``UnsupportedError`` where the FP8 step would not equal the unsharded one (``check_mesh``)
    or cannot run (a GPU without FP8 tensor cores)."""
    if config is None:
        return None
    if shard_plan is not None:
        check_mesh(config, state, shard_plan)
    device = state.step.device
    if device.type == "cuda" and (cc := torch.cuda.get_device_capability(device)) < (8, 9):
        raise UnsupportedError(f"Policy(matmul=fsg.Float8()) needs FP8 tensor cores (compute capability 8.9+: Ada, "
                               f"Hopper, Blackwell); {device} is sm_{cc[0]}{cc[1]}. Drop matmul= on this GPU")  # fmt: skip
    if device.type not in ("cuda", "cpu"):
        raise UnsupportedError(f"Policy(matmul=fsg.Float8()) runs on CUDA (and on CPU, slowly); got {device}")
    leaves, state_def = tree.flatten(state)
    index = tree.unflatten(state_def, list(range(len(leaves))))
    positions, params = tree.flatten(index.params)[0], tree.flatten(state.params)[0]
    names = tree.leaf_paths(state.params, "params")
    if isinstance(state.params, dict) and all(isinstance(v, torch.Tensor) for v in state.params.values()):
        keys = {id(v): k for k, v in state.params.items()}  # fsg.params' names, in flatten order
        names = [keys.get(id(p), name) for p, name in zip(params, names)]
    first = 0 if traced.donate else traced.num_state_leaves  # without donation the new state comes first
    groups = ()
    if shard_plan is not None and config.recipe == "tensorwise":
        mesh = shard_plan.mesh
        groups = tuple(mesh.device_mesh.get_group(a).group_name for a in shard_plan.data_axes if mesh.axis_size(a) > 1)
    loss = first + traced.metric_names.index("loss")
    return Float8Plan(config, dict(zip(positions, names)), loss, groups, traced.num_state_leaves)


def check_mesh(config: Float8, state: Any, shard_plan: Any) -> None:
    """FP8 on a mesh where each rank's matmuls see whole rows: every parameter whole at compute
    time (replicated, or gathered as FSDP does) and every batch leaf split along dim 0 only.
    Then a rank's rows and weight channels are the unsharded step's, so are their scales
    (rowwise: a row's own; tensorwise: the global batch's, each amax all-reduced over the
    batch's axes), and the sharded step equals the unsharded one. Anything else raises
    ``UnsupportedError`` naming what breaks it."""
    recipe = f"Float8(recipe={config.recipe!r})"
    names = tree.leaf_paths(state.params, "params")
    for i, name in enumerate(names):
        placements = shard_plan.compute_placements(i)
        if any(not isinstance(p, Replicate) for p in placements):
            raise UnsupportedError(f"{recipe} on a mesh: {name} is sharded where it is used "
                                   f"({placements}: tensor parallel), so its scale would see "
                                   "only part of it. FP8 runs with data parallel and FSDP; drop matmul= under tensor "
                                   "parallelism")  # fmt: skip
    for i, placements in enumerate(shard_plan.batch_placements):
        if any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)) for p in placements):
            raise UnsupportedError(f"{recipe} on a mesh: batch leaf {i} is split along a dim other "
                                   f"than 0 ({placements}), so a rank would cast parts of rows. Shard the "
                                   "batch along its leading dim only")  # fmt: skip


def _param_of(node: fx.Node, names: dict[fx.Node, str]) -> str | None:
    """The parameter ``node`` is a function of alone (through casts, views, markers), if any."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return names.get(node)


def _passes_loss(node: fx.Node) -> bool:
    """Whether the loss may be computed from a head's output through ``node``."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or facts.is_view(node) or _torch_private.is_collective(node.target):
        return True  # (on a mesh the loss is all-reduced: its collectives lead back to the head)
    tags = getattr(node.target, "tags", ())
    return (
        torch.Tag.pointwise in tags or torch.Tag.reduction in tags or _torch_private.op_name(node.target) in _LOSS_OPS
    )


def _reach(start: fx.Node, through: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The nodes ``start`` is computed from, walking up the inputs of the nodes ``through`` admits."""
    seen, stack = {start}, [start]
    while stack:
        node = stack.pop()
        for n in node.all_input_nodes if through(node) else ():
            if n not in seen:
                seen.add(n)
                stack.append(n)
    return seen


class _Layer(NamedTuple):
    forward: fx.Node
    x: fx.Node  # the activation the forward reads (the 2-D tensor under its views)
    w: fx.Node  # the weight
    name: str | None  # the weight's parameter name
    why_not: str | None  # why the layer stays in high precision


def _batch_dependent(graph: fx.Graph, batch_inputs: list[fx.Node]) -> set[fx.Node]:
    """The nodes computed from the batch (activations and gradients: a rank's own rows)."""
    out = set(batch_inputs)
    for node in graph.nodes:
        if any(n in out for n in node.all_input_nodes):
            out.add(node)
    return out


def _why_not_op(node: fx.Node, rowwise: bool = False) -> str | None:
    """Why this matmul cannot run as ``_scaled_mm`` whatever its layer, or ``None``."""
    if node.target is BMM:
        return "a batched (3-D) matmul, not a linear layer's"
    out = node.meta["val"]
    if out.dtype not in (torch.bfloat16, torch.float16):
        return f"it computes in {out.dtype} (FP8 replaces bfloat16 and float16 matmuls)"
    if rowwise and out.dtype != torch.bfloat16:
        return f"it computes in {out.dtype}; rowwise-scaled FP8 GEMMs write bfloat16 only (use recipe='tensorwise')"
    a, b, _ = operands(node)
    m, k, n = a.meta["val"].shape[0], a.meta["val"].shape[1], b.meta["val"].shape[1]
    if any(d % _DIM_MULTIPLE for d in (m, k, n)):
        return f"its dims M={m}, K={k}, N={n} are not all multiples of {_DIM_MULTIPLE}"
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 3:
        return "addmm with beta or alpha other than 1"
    return None


def _stay(n: int, what: str = "matmul") -> str:
    return f"1 {what} stays" if n == 1 else f"{n} {what}s stay"


def _listing(which: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``which``, and how many more (the ``fsg`` logger's DEBUG level
    names each)."""
    more = len(which) - shown
    return ", ".join(which[:shown]) + (f" and {more} more (DEBUG lists each)" if more > 0 else "")


def rewrite(gm: fx.GraphModule, at: Float8Plan, fusions: Fusions = DEFAULT) -> str:
    """Rewrites the selected matmuls of ``gm`` in place (see the module docstring), its casts
    fused where ``fusions`` says (``passes/float8/fuse.py``); returns a summary for the stage-3
    log."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = {placeholders[i]: name for i, name in at.param_names.items()}
    loss = graph.output_node().args[0][at.loss_output]
    forward = _reach(loss, lambda n: True)  # the loss's ancestors
    matmuls = [n for n in graph.nodes if n.op == "call_function" and n.target in (MM, ADDMM, BMM)]
    forward_mms = {n for n in matmuls if n in forward and n.target is not BMM}
    # the head: a forward matmul the loss is computed from through pointwise ops, views, softmax
    # and losses only, and no other such matmul is computed from (a residual stream's adds)
    heads = forward_mms & _reach(loss, lambda n: n not in forward_mms and _passes_loss(n))
    below = {h: _reach(h, lambda n: True) - {h} for h in heads}
    heads = {h for h in heads if at.config.keep_output_head and not any(h in below[o] for o in heads)}
    layers: dict[fx.Node, _Layer] = {}
    for node in (n for n in matmuls if n in forward_mms):
        (x, _), (w, _) = (peel(o) for o in operands(node)[:2])
        if _param_of(w, names) is None and _param_of(x, names) is not None:
            x, w = w, x  # the weight is the first operand (W @ X)
        name = _param_of(w, names)
        why = "it reads no parameter (not a linear layer)" if name is None else None
        if why is None and node in heads:
            why = "it is the output head (Float8(keep_output_head=True))"
        elif why is None and callable(at.config.filter) and not at.config.filter(name):
            why = f"Float8(filter=...) returned False for {name!r}"
        layers[node] = _Layer(node, x, w, name, why)
    by_saved: dict[fx.Node, list[_Layer]] = {}  # a tensor the forward saved -> the layers reading it
    for layer in layers.values():
        for t in {layer.x, layer.w}:
            by_saved.setdefault(t, []).append(layer)
    found, by_grad = [], {}  # by_grad: a gradient -> the layers whose grad-input reads it
    for node in (n for n in matmuls if n not in forward and n.target is not BMM):
        bases = [peel(o)[0] for o in operands(node)[:2]]
        grads = (bases[0] not in forward, bases[1] not in forward)
        if grads[0] != grads[1]:  # one gradient and one tensor the forward saved
            saved, grad = (bases[1], bases[0]) if grads[0] else (bases[0], bases[1])
            found.append((node, saved, grad, grads))
            by_grad.setdefault(grad, []).extend(c for c in by_saved.get(saved, []) if saved is c.w)
    roles: dict[fx.Node, tuple[list[_Layer], tuple[bool, bool], bool]] = {}  # ..., is a grad-weight
    for node, saved, grad, grads in found:
        candidates = by_saved.get(saved, [])
        if any(saved is c.x for c in candidates) and by_grad.get(grad):  # a grad-weight: the layer whose
            candidates = [c for c in candidates if c in by_grad[grad]] or candidates  # grad-input reads dY
        if candidates:
            roles[node] = (candidates, grads, saved is candidates[0].x)
    rowwise = at.config.recipe == "rowwise"
    if at.config.filter == "auto":
        layers, roles = float8_cost.apply(
            matmuls, layers, roles, at.config, partial(_why_not_op, rowwise=rowwise), fusions
        )
    batch = _batch_dependent(graph, placeholders[at.first_batch_input :]) if at.amax_groups else set()
    kept: dict[tuple[str, torch.dtype], list[str]] = {}  # (why, dtype) -> the matmuls that stay for it
    todo: list[tuple[fx.Node, tuple[bool, bool], bool]] = []  # (matmul, grads, fast accumulation)
    for node in matmuls:  # graph order: a tensor's scale and casts come before every reader
        why = _why_not_op(node, rowwise)
        if node in layers:
            why = why or layers[node].why_not
            grads, fast = (False, False), "forward" in at.config.fast_accum
        elif node in roles:
            candidates, grads, grad_weight = roles[node]
            why = why or next(
                (f"its layer ({c.name or c.forward.name}) stays: {c.why_not}" for c in candidates if c.why_not), None
            )
            if why is None and grad_weight and not at.config.fp8_grad_weight:
                why = (f"Float8(recipe={at.config.recipe!r}, grad_weight={at.config.grad_weight!r}) keeps the "
                       "grad-weight in the compute dtype (grad_weight='fp8' runs it in FP8)")  # fmt: skip
            fast = ("grad_weight" if grad_weight else "grad_input") in at.config.fast_accum
        else:
            why = why or "it is not part of a linear layer (no forward matmul reads its operand)"
        if why is not None:
            shapes = " x ".join(str(list(o.meta["val"].shape)) for o in node.all_input_nodes)
            log.debug("fsg: float8: %s (%s) stays in %s: %s", node.name, shapes, node.meta["val"].dtype, why)
            reason = re.sub(r"its layer \([^)]*\) stays", "its layer stays", why)  # (INFO: a line a reason)
            kept.setdefault((reason, node.meta["val"].dtype), []).append(f"{node.name} ({shapes})")
            continue
        todo.append((node, grads, fast))
    reads_flipped = flipped([node for node, _, _ in todo]) if rowwise else set()
    quantizer = Quantizer(graph, rowwise, at.amax_groups, batch, reads_flipped, fusions)
    gathered, stay = fsdp_gathers(graph, {n for n, _, _ in todo}, lambda w: _param_of(w, names)) if (
        at.config.all_gather == "fp8") else ([], {})  # fmt: skip
    for why, which in stay.items():
        log.info(
            "fsg: float8: %s in the compute dtype: %s: %s", _stay(len(which), "weight gather"), why, _listing(which)
        )
    quantizer.gather_in_fp8(gathered)
    for node, grads, fast in todo:
        quantizer.matmul(node, grads, fast)
    for (why, dtype), which in kept.items():  # one line a reason: a 1.3B GPT keeps 96 grad-weights for one
        log.info("fsg: float8: %s in %s: %s: %s", _stay(len(which)), dtype, why, _listing(which))
    graph.eliminate_dead_code()
    for wait in gathered:  # the compute-dtype gathers, now unread (FX keeps a wait as impure)
        collective = wait.args[0]
        graph.erase_node(wait)
        graph.erase_node(collective)
    gm.recompile()
    summary = f"{len(todo)} of {len(matmuls)} matmuls in FP8"
    return summary + (f", {len(gathered)} weight{'s' * (len(gathered) > 1)} gathered in FP8" if gathered else "")
