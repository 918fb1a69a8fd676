"""Stage 3 graph pass: the linear layers' matmuls as FP8 ``_scaled_mm`` (``Policy(matmul=fsg.Float8())``).

Shapes: M rows (tokens), K the contracted width, N the output width. A linear layer is three
matmuls of the joint graph: the forward ``Y_MN = X_MK @ W_NK^T`` (``mm`` or ``addmm`` reading
the weight through ``t``), the grad-input ``dX_MK = dY_MN @ W_NK`` and the grad-weight
``dW_NK = dY_MN^T @ X_MK``. The pass finds the forward matmuls (the loss's ancestors), groups
each backward matmul with the forward whose saved operand (``W`` or ``X``) it reads, and
rewrites every matmul of a selected layer as ``aten._scaled_mm`` with tensorwise dynamic
scaling computed in the graph: ``amax = max|t|``, ``scale = fp8_max / max(amax, eps)``,
``t8 = saturate(t * scale)`` in ``float8_e4m3fn`` for ``X`` and ``W``, ``float8_e5m2`` for ``dY``,
and ``1 / scale`` handed to ``_scaled_mm``. Each tensor is scaled and cast once; the other
layout ``_scaled_mm`` needs (row-major first operand, column-major second) is a transposed
copy of that FP8 cast; every matmul that reads the tensor reuses them. A matmul that cannot
or should not run in FP8 stays as it was and gets one INFO line on the ``fsg`` logger saying
why (docs/precision.md#fp8).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, NamedTuple

import torch
from torch import fx

from fsg._src import _torch_private, tree
from fsg._src import graph_facts as facts
from fsg._src.errors import UnsupportedError
from fsg._src.precision import Float8

log = logging.getLogger("fsg")
aten = torch.ops.aten
MM, ADDMM, BMM, SCALED_MM = aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # the smallest amax a scale is computed from (an all-zero tensor gets a finite scale)
_DIM_MULTIPLE = 16  # cuBLASLt's FP8 GEMMs need every dim a multiple of 16
_ALIASES = (aten.detach.default, aten.alias.default)
_DENSE = {"memory_format": torch.contiguous_format}
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


def plan(config: Float8 | None, state: Any, traced: Any, *, on_mesh: bool) -> Float8Plan | None:
    """The pass's plan for a traced step (``None`` without ``Policy(matmul=...)``); raises
    ``UnsupportedError`` where FP8 matmuls are not built (a mesh) or cannot run (a GPU without
    FP8 tensor cores)."""
    if config is None:
        return None
    if on_mesh:
        raise UnsupportedError("Policy(matmul=fsg.Float8()) on a mesh is not built yet (issue 18: scales would be "
                               "per rank, FP8 all-gathers are planned); use it on one device or drop matmul=")  # fmt: skip
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
    return Float8Plan(config, dict(zip(positions, names)), first + traced.metric_names.index("loss"))


def _peel(node: fx.Node) -> tuple[fx.Node, bool]:
    """The 2-D tensor a matmul operand reads through aliases and transposes, and whether the
    operand is its transpose."""
    transposed = False
    while node.op == "call_function":
        if node.target in _ALIASES:
            node = node.args[0]
        elif node.target is aten.t.default or (
            node.target is aten.transpose.int and node.args[1] % 2 != node.args[2] % 2
        ):
            node, transposed = node.args[0], not transposed  # (the operands are 2-D: dims mod 2)
        else:
            break
    return node, transposed


def _param_of(node: fx.Node, names: dict[fx.Node, str]) -> str | None:
    """The parameter ``node`` is a function of alone (through casts, views, markers), if any."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return names.get(node)


def _passes_loss(node: fx.Node) -> bool:
    """Whether the loss may be computed from a head's output through ``node``."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or facts.is_view(node):
        return True
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


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    if node.target is ADDMM:
        return node.args[1], node.args[2], node.args[0]
    return node.args[0], node.args[1], None


def _why_not_op(node: fx.Node, rowwise: bool = False) -> str | None:
    """Why this matmul cannot run as ``_scaled_mm`` whatever its layer, or ``None``."""
    if node.target is BMM:
        return "a batched (3-D) matmul, not a linear layer's"
    out = node.meta["val"]
    if out.dtype not in (torch.bfloat16, torch.float16):
        return f"it computes in {out.dtype} (FP8 replaces bfloat16 and float16 matmuls)"
    if rowwise and out.dtype != torch.bfloat16:
        return f"it computes in {out.dtype}; rowwise-scaled FP8 GEMMs write bfloat16 only (use recipe='tensorwise')"
    a, b, _ = _operands(node)
    m, k, n = a.meta["val"].shape[0], a.meta["val"].shape[1], b.meta["val"].shape[1]
    if any(d % _DIM_MULTIPLE for d in (m, k, n)):
        return f"its dims M={m}, K={k}, N={n} are not all multiples of {_DIM_MULTIPLE}"
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 3:
        return "addmm with beta or alpha other than 1"
    return None


class _Quantizer:
    """Builds the scale and the FP8 casts of each tensor once, before its first reader."""

    def __init__(self, graph: fx.Graph, rowwise: bool = False) -> None:
        self.graph, self.mode, self.rowwise = graph, _torch_private.fake_mode(), rowwise
        # tensorwise: (t, dtype) -> (scale, 1/scale); rowwise: (t, flip, dtype) -> 1/scale
        self.scales: dict[tuple, Any] = {}
        self.casts: dict[tuple[fx.Node, bool, torch.dtype], fx.Node] = {}

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})

        def fake(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            v = a.meta["val"]
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)

        with self.mode:
            node.meta["val"] = target(*fx.node.map_aggregate(args, fake), **fx.node.map_aggregate(kwargs or {}, fake))
        return node

    def scale(self, t: fx.Node, dtype: torch.dtype) -> tuple[fx.Node, fx.Node]:
        """``fp8_max / max(amax(t), eps)`` in float32, and its reciprocal (``_scaled_mm``'s scale)."""
        if (t, dtype) not in self.scales:
            amax = self.call(aten.max.default, (self.call(aten.abs.default, (t,)),))
            amax = self.call(aten._to_copy.default, (amax,), {"dtype": torch.float32})
            inv_amax = self.call(aten.reciprocal.default, (self.call(aten.clamp_min.default, (amax, EPS)),))
            scale = self.call(aten.mul.Tensor, (inv_amax, torch.finfo(dtype).max))
            self.scales[(t, dtype)] = (scale, self.call(aten.reciprocal.default, (scale,)))
        return self.scales[(t, dtype)]

    def operand(self, t: fx.Node, transposed: bool, dtype: torch.dtype, second: bool) -> tuple[fx.Node, fx.Node]:
        """The FP8 operand for ``t`` (or its transpose): row-major as ``_scaled_mm``'s first
        operand, column-major (the transpose of a row-major cast) as its second; and its
        inverse scale. ``t`` is cast once; its other layout is a transposed copy of that cast
        (the same values: one scale per tensor), which reads one byte an element instead of
        two and lets the backward keep the FP8 copy instead of ``t``."""
        flip = transposed != second  # the row-major copy needed is of t's transpose
        if self.rowwise:
            return self.rowwise_operand(t, flip, dtype, second)
        scale, inv = self.scale(t, dtype)
        if (t, flip, dtype) not in self.casts:
            if (other := self.casts.get((t, not flip, dtype))) is not None:
                cast = self.call(aten.clone.default, (self.call(aten.t.default, (other,)),), _DENSE)
            else:
                fp8_max, wide = torch.finfo(dtype).max, self.call(aten.t.default, (t,)) if flip else t
                wide = self.call(aten._to_copy.default, (wide,), {"dtype": torch.float32})
                scaled = self.call(aten.clamp.default, (self.call(aten.mul.Tensor, (wide, scale)), -fp8_max, fp8_max))
                cast = self.call(aten._to_copy.default, (scaled,), {"dtype": dtype, **_DENSE})
            self.casts[(t, flip, dtype)] = cast
        cast = self.casts[(t, flip, dtype)]
        return (self.call(aten.t.default, (cast,)) if second else cast), inv

    def rowwise_operand(self, t: fx.Node, flip: bool, dtype: torch.dtype, second: bool) -> tuple[fx.Node, fx.Node]:
        """The rowwise FP8 operand: ``R`` (``t`` or its transpose, row-major, each row one dot
        product's run along the contracted dim) scaled row by row, ``scale = fp8_max /
        max(amax(|R|, dim=1), eps)``, and the inverse scales as ``_scaled_mm`` takes them:
        ``[M, 1]`` for the first operand, ``[1, N]`` (the second's columns) for the second.
        Each row's amax is a reduction over one row, so the cast needs no pass over the whole
        tensor first and can run in the kernel that produces the row."""
        if (t, flip, dtype) not in self.casts:
            rows = self.call(aten.t.default, (t,)) if flip else t
            amax = self.call(aten.amax.default, (self.call(aten.abs.default, (rows,)), [1], True))
            amax = self.call(aten._to_copy.default, (amax,), {"dtype": torch.float32})
            fp8_max = torch.finfo(dtype).max
            scale = self.call(aten.mul.Tensor, (self.call(aten.reciprocal.default,
                              (self.call(aten.clamp_min.default, (amax, EPS)),)), fp8_max))  # fmt: skip
            wide = self.call(aten._to_copy.default, (rows,), {"dtype": torch.float32})
            scaled = self.call(aten.clamp.default, (self.call(aten.mul.Tensor, (wide, scale)), -fp8_max, fp8_max))
            cast = self.call(aten._to_copy.default, (scaled,), {"dtype": dtype, **_DENSE})
            self.casts[(t, flip, dtype)] = cast
            self.scales[(t, flip, dtype)] = self.call(aten.reciprocal.default, (scale,))
        cast, inv = self.casts[(t, flip, dtype)], self.scales[(t, flip, dtype)]
        if second:
            return self.call(aten.t.default, (cast,)), self.call(aten.t.default, (inv,))
        return cast, inv

    def matmul(self, node: fx.Node, grads: tuple[bool, bool], fast: bool) -> fx.Node:
        """``node`` (mm or addmm) as ``_scaled_mm``; ``grads`` says which operands are gradients."""
        a, b, bias = _operands(node)
        out_dtype = node.meta["val"].dtype
        with self.graph.inserting_before(node):
            grad_dtype = E4M3 if self.rowwise else E5M2  # rowwise: a scale per row covers the range
            qa, inv_a = self.operand(*_peel(a), grad_dtype if grads[0] else E4M3, second=False)
            qb, inv_b = self.operand(*_peel(b), grad_dtype if grads[1] else E4M3, second=True)
            fused = bias is not None and bias.meta["val"].shape == node.meta["val"].shape[-1:]
            fused = fused and bias.meta["val"].dtype == out_dtype  # cuBLASLt's epilogue: a [N] bias of the output dtype
            kwargs = {"bias": bias if fused else None, "out_dtype": out_dtype, "use_fast_accum": fast}
            out = self.call(SCALED_MM, (qa, qb, inv_a, inv_b), kwargs)
            if bias is not None and not fused:
                out = self.call(aten.add.Tensor, (out, bias))
        out.meta = {**node.meta, "val": out.meta["val"]}
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)
        return out


def rewrite(gm: fx.GraphModule, at: Float8Plan) -> str:
    """Rewrites the selected matmuls of ``gm`` in place (see the module docstring); returns a
    summary for the stage-3 log."""
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
        (x, _), (w, _) = (_peel(o) for o in _operands(node)[:2])
        if _param_of(w, names) is None and _param_of(x, names) is not None:
            x, w = w, x  # the weight is the first operand (W @ X)
        name = _param_of(w, names)
        why = "it reads no parameter (not a linear layer)" if name is None else None
        if why is None and node in heads:
            why = "it is the output head (Float8(keep_output_head=True))"
        elif why is None and at.config.filter is not None and not at.config.filter(name):
            why = f"Float8(filter=...) returned False for {name!r}"
        layers[node] = _Layer(node, x, w, name, why)
    by_saved: dict[fx.Node, list[_Layer]] = {}  # a tensor the forward saved -> the layers reading it
    for layer in layers.values():
        for t in {layer.x, layer.w}:
            by_saved.setdefault(t, []).append(layer)
    found, by_grad = [], {}  # by_grad: a gradient -> the layers whose grad-input reads it
    for node in (n for n in matmuls if n not in forward and n.target is not BMM):
        bases = [_peel(o)[0] for o in _operands(node)[:2]]
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
    quantizer, converted = _Quantizer(graph, rowwise), 0
    for node in matmuls:  # graph order: a tensor's scale and casts come before every reader
        why = _why_not_op(node, rowwise)
        if node in layers:
            why = why or layers[node].why_not
            grads, fast = (False, False), True  # the forward accumulates fast, as torchao's
        elif node in roles:
            candidates, grads, grad_weight = roles[node]
            why = why or next(
                (f"its layer ({c.name or c.forward.name}) stays: {c.why_not}" for c in candidates if c.why_not), None
            )
            if why is None and rowwise and grad_weight:
                why = ("recipe='rowwise' keeps the grad-weight in the compute dtype (its scales would run "
                       "along the tokens: a second pass over dY and X)")  # fmt: skip
            fast = False
        else:
            why = why or "it is not part of a linear layer (no forward matmul reads its operand)"
        if why is not None:
            shapes = " x ".join(str(list(o.meta["val"].shape)) for o in node.all_input_nodes)
            log.info("fsg: float8: %s (%s) stays in %s: %s", node.name, shapes, node.meta["val"].dtype, why)
            continue
        quantizer.matmul(node, grads, fast)
        converted += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return f"{converted} of {len(matmuls)} matmuls in FP8"
