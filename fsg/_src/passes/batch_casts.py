"""Stage 3 graph pass: the parameters' casts to the compute dtype as one launch.

Under ``Policy(compute=bfloat16)`` the traced step casts each float32 parameter where the
forward reads it, ``_to_copy(param, dtype=bfloat16)``, and Inductor gives each cast a kernel
of its own (fused at most with a transpose): at GPT-2 124M about 107 small launches, slower
than one ``cast_flat`` launch moving the same bytes (benchmarks/RESULTS.md).
``batch_casts`` replaces every such cast of a step input (a parameter, read directly or
through ``detach``, ``alias`` or a view to its own shape, as stage 2 hands a rank its local
tensor) by a view of one ``fsg::cast_flat`` buffer (``kernels/cast_flat.py``: one multi-tensor
launch at the start of the step), grouped by source and target dtype; an input cast more than
once is cast once. The values are the same bits (the same rounding of the same float32
numbers); what changes is when they are written, all at the start, and how long they live:
the buffer is freed after the last read of any of its views (a slightly higher peak:
benchmarks/RESULTS.md). A cast read by an FP8 ``_scaled_mm`` (its bias) stays its own
kernel: Inductor's lowering of ``_scaled_mm`` cannot take a slice of a larger buffer there.
So does a cast an all-gather reads (FSDP's shard, cast before its gather): the gathers'
bucketing (``prefetch.py``) packs each bucket's shards from their casts, into the bucket's
buffer, in one kernel; a view of the flat buffer there would keep the gather out of its
bucket (one collective per parameter: 28 instead of 1 for the tiny GPT of
tests/dist/test_precision.py) and copy the bytes once more.

It applies to 16-bit targets on CUDA (``Fusions(on_cpu={"batch_casts"})`` extends it to CPU,
where the op runs ``copy_`` casts: how the CPU tests check the rewrite), where a group has at least two casts;
the rewrite is local to the graph it is given, so on a mesh it runs on each rank's graph (data
parallel: the replicated parameters; FSDP: the shards, cast before their gathers; tensor
parallel: the local pieces).
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.kernels import cast_flat  # registers the op
from fsg._src.passes import moves
from fsg._src.passes.options import DEFAULT, Fusions

aten = torch.ops.aten
CAST_FLAT = torch.ops.fsg.cast_flat.default
_TARGETS = (torch.bfloat16, torch.float16)


def _source(cast: fx.Node, fusions: Fusions) -> fx.Node | None:
    """The step input ``cast`` converts (through detaches, aliases and same-shape views), if it
    is a plain cast of one to a 16-bit dtype on CUDA (or on CPU where ``fusions.on_cpu`` names
    the pass) that keeps its layout; else ``None``."""
    if cast.op != "call_function" or cast.target is not aten._to_copy.default or len(cast.args) != 1:
        return None
    if set(cast.kwargs) != {"dtype"} or cast.kwargs["dtype"] not in _TARGETS:
        return None
    src = cast.args[0]
    while isinstance(src, fx.Node) and src.op == "call_function" and same_tensor(src):
        src = src.args[0]
    if not isinstance(src, fx.Node) or src.op != "placeholder":
        return None
    val = src.meta.get("val")
    ok = (
        isinstance(val, torch.Tensor)
        and val.is_floating_point()
        and val.dtype != cast.kwargs["dtype"]
        and val.is_contiguous()
        and val.numel() > 0
        and fusions.on("batch_casts", val.device.type)
    )
    return src if ok else None


def _stays(cast: fx.Node) -> bool:
    """Whether ``cast`` (or a view of it) is read by an op that needs it as a cast of its own:
    ``_scaled_mm`` (the FP8 matmuls' bias: Inductor's ``_scaled_mm`` lowering, torch 2.11's
    ``adjust_kernel_inputs``, unsqueezes the bias as if it were its whole buffer, and a slice
    of the flat buffer fails its size check at compile time, tests/gpu/test_float8_cuda.py), or
    an all-gather (FSDP's shard: the gathers' buckets pack their shards from the casts)."""
    seen, todo = set(), [cast]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.target in (aten._scaled_mm.default, _torch_private.ALL_GATHER):
                return True
            if user.target in moves.VIEWS and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def same_tensor(node: fx.Node) -> bool:
    """Whether ``node`` is its first argument under another name: a ``detach``, an ``alias``, or
    a view to the same shape (how stage 2 hands a rank the local tensor of a parameter)."""
    if node.target in (aten.detach.default, aten.alias.default):
        return True
    if node.target is not aten.view.default or not isinstance(node.args[0], fx.Node):
        return False
    before, after = moves.meta_value(node.args[0]), moves.meta_value(node)
    return before is not None and after is not None and before.shape == after.shape


def batch_casts(gm: fx.GraphModule, fusions: Fusions = DEFAULT) -> int:
    """Rewrites the casts of step inputs as views of one ``fsg::cast_flat`` per (source
    dtype, target dtype, device) group (see the module docstring); returns how many."""
    groups: dict[tuple, list[tuple[fx.Node, fx.Node]]] = {}
    for node in gm.graph.nodes:
        src = _source(node, fusions)
        if src is not None and not _stays(node):
            val = src.meta["val"]
            groups.setdefault((val.dtype, node.kwargs["dtype"], val.device), []).append((node, src))
    mode, done = _torch_private.fake_mode(), 0
    for (_, dtype, _), pairs in groups.items():
        sources = list(dict.fromkeys(src for _, src in pairs))  # an input cast twice is cast once
        if len(sources) < 2:
            continue
        starts = dict(zip(sources, cast_flat.flat_offsets([s.meta["val"].numel() for s in sources])[0]))
        with gm.graph.inserting_before(pairs[0][0]):
            flat = _call(gm.graph, mode, CAST_FLAT, (sources, dtype))
        for cast, src in pairs:
            start = starts[src]
            shape = list(cast.meta["val"].shape)
            with gm.graph.inserting_before(cast):
                piece = _call(gm.graph, mode, aten.slice.Tensor, (flat, 0, start, start + cast.meta["val"].numel()))
                view = _call(gm.graph, mode, aten.view.default, (piece, shape))
            cast.replace_all_uses_with(view)
            between = cast.args[0]
            gm.graph.erase_node(cast)
            while between is not src and not between.users:  # the detaches and views nothing reads now
                between, dead = between.args[0], between
                gm.graph.erase_node(dead)
            done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _call(graph: fx.Graph, mode, target, args: tuple) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = _torch_private.fake_result(mode, target, args)
    return node
