"""How a matmul becomes an FP8 ``_scaled_mm`` (the graph ops of ``passes/float8/matmuls.py``'s rewrite).

``Quantizer`` inserts, before a matmul, the scale and FP8 cast of each operand and the
``_scaled_mm`` that replaces it: tensorwise (one scale per tensor, its other layout a
transposed copy of the one cast) or rowwise (a scale per row along the contracted dim). Each
tensor's scale and casts are built once and reused by every matmul that reads it.

FSDP's gathered weights under ``Float8(all_gather="fp8")`` (tensorwise): ``gather_in_fp8`` casts
each rank's shard instead of the gathered weight. The shards' amaxes go into one vector that one
all-reduce (max) over the gathers' group makes global; each shard is cast with its weight's
global scale and gathered as bytes (at the step's start, where stage 2 put the gathers;
``prefetch.py`` then packs these gathers into FSDP's buckets), and each gather is waited for
right before its first matmul. The cast is elementwise and the global amax is the gathered
weight's, so the gathered FP8 weight is bit for bit the cast of the bf16 one, in half the bytes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.kernels.fp8 import cast as float8_cast
from fsg._src.passes.float8 import fuse as float8_fuse
from fsg._src.passes.options import DEFAULT, Fusions

aten = torch.ops.aten
ADDMM, SCALED_MM = aten.addmm.default, aten._scaled_mm.default
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = float8_cast.EPS  # the smallest amax a scale is computed from (an all-zero tensor gets a finite scale)
_ALIASES = (aten.detach.default, aten.alias.default)
_DENSE = {"memory_format": torch.contiguous_format}


def _whole_slice(node: fx.Node) -> bool:
    """Whether ``node`` is a slice that keeps all of its input (stage 2 reads some gathered
    weights through ``slice(w, 0, 0, len(w))``, seen from width 128 on)."""
    if node.target is not aten.slice.Tensor or not isinstance(node.args[0], fx.Node):
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    return before is not None and after is not None and tuple(before.shape) == tuple(after.shape)


def peel(node: fx.Node) -> tuple[fx.Node, bool]:
    """The 2-D tensor a matmul operand reads through aliases, whole slices and transposes, and
    whether the operand is its transpose."""
    transposed = False
    while node.op == "call_function":
        if node.target in _ALIASES or _whole_slice(node):
            node = node.args[0]
        elif node.target is aten.t.default or (
            node.target is aten.transpose.int and node.args[1] % 2 != node.args[2] % 2
        ):
            node, transposed = node.args[0], not transposed  # (the operands are 2-D: dims mod 2)
        else:
            break
    return node, transposed


def operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    if node.target is ADDMM:
        return node.args[1], node.args[2], node.args[0]
    return node.args[0], node.args[1], None


def flipped(matmuls: list[fx.Node]) -> set[fx.Node]:
    """The tensors (``float8_fuse.rows_base``) these matmuls read as the transpose of a
    row-major cast (rowwise: ``X`` and ``dY`` of a grad-weight in FP8, and each weight a
    grad-input reads), whose two casts ``fsg::weight_fp8`` can compute together."""
    out = set()
    for node in matmuls:
        for operand, second in zip(operands(node)[:2], (False, True)):
            t, transposed = peel(operand)
            if transposed != second:
                out.add(float8_fuse.rows_base(t))
    return out


def _gather_wait(node: fx.Node, depth: int = 4) -> fx.Node | None:
    """The wait of the all-gather ``node`` is (or is a view or slice of, up to ``depth`` ops up)."""
    for _ in range(depth + 1):
        if node.op != "call_function":
            return None
        if node.target is _torch_private.WAIT_TENSOR:
            collective = node.args[0]
            return node if isinstance(collective, fx.Node) and collective.target is _torch_private.ALL_GATHER else None
        if len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    return None


def fsdp_gathers(graph: fx.Graph, fp8: set[fx.Node], name_of: Any) -> tuple[list[fx.Node], dict[str, list[str]]]:
    """FSDP's weight gathers (their waits, in graph order) that ``Float8(all_gather="fp8")``
    gathers in FP8: those of 16-bit weights only the matmuls in ``fp8`` read, as an operand,
    through transposes and aliases; and, for the others an FP8 matmul reads, why each stays
    (``{why: [weight names]}``)."""

    def readers(node: fx.Node) -> list[fx.Node]:
        return [r for u in node.users for r in (readers(u) if peel(u)[0] is not u else [u])]

    position = {n: i for i, n in enumerate(graph.nodes)}
    eligible, seen, stay = [], set(), {}
    for matmul in sorted(fp8, key=position.__getitem__):
        for operand in operands(matmul)[:2]:
            base = peel(operand)[0]
            if (wait := _gather_wait(base)) is None or wait in seen:
                continue
            seen.add(wait)
            dtype = getattr(wait.meta.get("val"), "dtype", None)
            others = [r for r in readers(wait) if r not in fp8 or all(peel(o)[0] is not wait for o in operands(r)[:2])]
            if wait is not base:
                why = "gathered, then sliced or reshaped (an uneven shard's padding, or a dim other than 0)"
            elif dtype not in (torch.bfloat16, torch.float16):
                why = f"gathered in {dtype}, not a 16-bit compute dtype"
            elif others:
                why = f"{others[0].target} reads it too, in the compute dtype"
            else:
                eligible.append(wait)
                continue
            stay.setdefault(why, []).append(name_of(wait) or wait.name)
    return sorted(eligible, key=position.__getitem__), stay


class Quantizer:
    """Builds the scale and the FP8 casts of each tensor once, before its first reader."""

    def __init__(
        self,
        graph: fx.Graph,
        rowwise: bool = False,
        amax_groups: tuple[str, ...] = (),
        batch: frozenset | set = frozenset(),
        flipped: frozenset | set = frozenset(),
        fusions: Fusions = DEFAULT,
    ) -> None:
        self.graph, self.mode, self.rowwise = graph, _torch_private.fake_mode(), rowwise
        # tensorwise on a mesh: each amax of a tensor in ``batch`` is all-reduced (max) over these groups
        self.amax_groups, self.batch = amax_groups, batch
        # tensorwise: (t, dtype) -> (scale, 1/scale); rowwise: (t, flip, dtype) -> 1/scale
        self.scales: dict[tuple, Any] = {}
        self.casts: dict[tuple[fx.Node, bool, torch.dtype], fx.Node] = {}
        # rowwise: the tensors (``float8_fuse.rows_base``) some matmul reads transposed, and
        # which fused ops may compute a cast (``float8_fuse.fuse``)
        self.flipped, self.fusions = flipped, fusions
        self.gathers: dict[fx.Node, fx.Node] = {}  # an FSDP gather's wait -> its FP8 gather (gather_in_fp8)

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})
        node.meta["val"] = _torch_private.fake_result(self.mode, target, args, kwargs)
        return node

    def scale(self, t: fx.Node, dtype: torch.dtype) -> tuple[fx.Node, fx.Node]:
        """``fp8_max / max(amax(t), eps)`` in float32, and its reciprocal (``_scaled_mm``'s scale)."""
        if (t, dtype) not in self.scales:
            amax = self.call(aten.max.default, (self.call(aten.abs.default, (t,)),))
            if self.amax_groups and t in self.batch:  # the global batch's amax: a rank holds some of its rows
                amax = self.call(aten._to_copy.default, (amax,), {"dtype": torch.float32})
                for group in self.amax_groups:
                    reduced = self.call(_torch_private.ALL_REDUCE, (amax, "max", group))
                    amax = self.call(_torch_private.WAIT_TENSOR, (reduced,))
            scale = self.scale_of(amax, dtype)
            self.scales[(t, dtype)] = (scale, self.call(aten.reciprocal.default, (scale,)))
        return self.scales[(t, dtype)]

    def scale_of(self, amax: fx.Node, dtype: torch.dtype) -> fx.Node:
        """``fp8_max / max(amax, eps)`` in float32 (``amax`` a scalar or a column of row maxima)."""
        amax = self.call(aten._to_copy.default, (amax,), {"dtype": torch.float32})
        inv_amax = self.call(aten.reciprocal.default, (self.call(aten.clamp_min.default, (amax, EPS)),))
        return self.call(aten.mul.Tensor, (inv_amax, torch.finfo(dtype).max))

    def cast(self, t: fx.Node, scale: fx.Node, dtype: torch.dtype) -> fx.Node:
        """``saturate(t * scale)`` in ``dtype``, row-major (the multiply in float32)."""
        fp8_max, wide = torch.finfo(dtype).max, self.call(aten._to_copy.default, (t,), {"dtype": torch.float32})
        scaled = self.call(aten.clamp.default, (self.call(aten.mul.Tensor, (wide, scale)), -fp8_max, fp8_max))
        return self.call(aten._to_copy.default, (scaled,), {"dtype": dtype, **_DENSE})

    def operand(self, t: fx.Node, transposed: bool, dtype: torch.dtype, second: bool) -> tuple[fx.Node, fx.Node]:
        """The FP8 operand for ``t`` (or its transpose): row-major as ``_scaled_mm``'s first
        operand, column-major (the transpose of a row-major cast) as its second; and its
        inverse scale (rowwise: ``rowwise_operand``). Tensorwise, ``t`` is cast once; its
        other layout is a transposed copy of that cast
        (the same values: one scale per tensor), which reads one byte an element instead of
        two and lets the backward keep the FP8 copy instead of ``t``."""
        flip = transposed != second  # the row-major copy needed is of t's transpose
        if self.rowwise:
            return self.rowwise_operand(t, flip, dtype, second)
        scale, inv = self.scale(t, dtype)
        if (t, flip, dtype) not in self.casts:
            if (other := self.casts.get((t, not flip, dtype))) is not None:
                cast = self.call(aten.clone.default, (self.call(aten.t.default, (other,)),), _DENSE)
            elif t in self.gathers:  # (its scale came with it: E4M3) waited for here, before its first matmul
                gathered = self.call(_torch_private.WAIT_TENSOR, (self.gathers[t],))
                self.casts[(t, False, dtype)] = self.call(aten.view.dtype, (gathered, dtype))
                return self.operand(t, transposed, dtype, second)
            else:
                cast = self.cast(self.call(aten.t.default, (t,)) if flip else t, scale, dtype)
            self.casts[(t, flip, dtype)] = cast
        cast = self.casts[(t, flip, dtype)]
        return (self.call(aten.t.default, (cast,)) if second else cast), inv

    def gather_in_fp8(self, waits: list[fx.Node]) -> None:
        """Each weight in ``waits`` (an FSDP gather's wait, read by FP8 matmuls only, as
        ``E4M3``) gets its scale and its FP8 gather (module docstring), inserted after the last
        of the shards: per process group, the shards' amaxes in one all-reduce (max)."""
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        by_group: dict[tuple, list[fx.Node]] = {}
        for wait in waits:
            by_group.setdefault(tuple(wait.args[0].args[1:]), []).append(wait)
        for (_, group), group_waits in by_group.items():
            shards = [wait.args[0].args[0] for wait in group_waits]
            with self.graph.inserting_before(max(shards, key=position.__getitem__).next):
                amaxes = [self.call(aten.max.default, (self.call(aten.abs.default, (s,)),)) for s in shards]
                amaxes = [self.call(aten._to_copy.default, (a,), {"dtype": torch.float32}) for a in amaxes]
                reduced = self.call(_torch_private.ALL_REDUCE, (self.call(aten.stack.default, (amaxes,)), "max", group))
                amax = self.call(_torch_private.WAIT_TENSOR, (reduced,))
                for i, (wait, shard) in enumerate(zip(group_waits, shards)):
                    scale = self.scale_of(self.call(aten.select.int, (amax, 0, i)), E4M3)
                    self.scales[(wait, E4M3)] = (scale, self.call(aten.reciprocal.default, (scale,)))
                    as_bytes = self.call(aten.view.dtype, (self.cast(shard, scale, E4M3), torch.uint8))
                    self.gathers[wait] = self.call(wait.args[0].target, (as_bytes, *wait.args[0].args[1:]))

    def rowwise_operand(self, t: fx.Node, flip: bool, dtype: torch.dtype, second: bool) -> tuple[fx.Node, fx.Node]:
        """The rowwise FP8 operand: ``R`` (``t`` or its transpose, row-major, each row one dot
        product's run along the contracted dim) scaled row by row, ``scale = fp8_max /
        max(amax(|R|, dim=1), eps)``, and the inverse scales as ``_scaled_mm`` takes them:
        ``[M, 1]`` for the first operand, ``[1, N]`` (the second's columns) for the second.
        Each row's amax is a reduction over one row, so the cast needs no pass over the whole
        tensor first and can run in the kernel that produces the row."""
        if not flip and (t, flip, dtype) not in self.casts:
            float8_fuse.fuse(self, t, dtype)  # (where it applies: a weight's flipped cast too)
        if (t, flip, dtype) not in self.casts:
            rows = self.call(aten.t.default, (t,)) if flip else t
            amax = self.call(aten.amax.default, (self.call(aten.abs.default, (rows,)), [1], True))
            scale = self.scale_of(amax, dtype)
            self.casts[(t, flip, dtype)] = self.cast(rows, scale, dtype)
            self.scales[(t, flip, dtype)] = self.call(aten.reciprocal.default, (scale,))
        cast, inv = self.casts[(t, flip, dtype)], self.scales[(t, flip, dtype)]
        if second:
            return self.call(aten.t.default, (cast,)), self.call(aten.t.default, (inv,))
        return cast, inv

    def item(self, node: fx.Node, i: int) -> fx.Node:
        """``node[i]`` of an op that returns a tuple."""
        out = self.graph.call_function(operator.getitem, (node, i))
        out.meta["val"] = node.meta["val"][i]
        return out

    def matmul(self, node: fx.Node, grads: tuple[bool, bool], fast: bool) -> fx.Node:
        """``node`` (mm or addmm) as ``_scaled_mm``; ``grads`` says which operands are gradients."""
        a, b, bias = operands(node)
        out_dtype = node.meta["val"].dtype
        with self.graph.inserting_before(node):
            grad_dtype = E4M3 if self.rowwise else E5M2  # rowwise: a scale per row covers the range
            qa, inv_a = self.operand(*peel(a), grad_dtype if grads[0] else E4M3, second=False)
            qb, inv_b = self.operand(*peel(b), grad_dtype if grads[1] else E4M3, second=True)
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
