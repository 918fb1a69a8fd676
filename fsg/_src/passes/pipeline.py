"""The stage-3 pipeline: which passes run, in what order, on a copy of the graph.

Each pass is a function ``(graph_module, options) -> result`` that rewrites the graph it is
given. ``PASSES`` declares each pass with the condition under which it applies and the passes
it must follow (``after``); ``order`` sorts them by those requirements (declaration order
breaks ties), so a new pass states what it needs instead of finding a slot in a docstring.
``run`` copies the graph in, so the stage-2 (or stage-1) graph it was given stays as it was for
``Step.lower``, and runs each applicable pass through ``run_pass`` (invariants checked under
``FSG_CHECK_PASSES=1``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import (
    batch_casts,
    buckets,
    defer,
    fuse_adamw,
    gemm_epilogues,
    narrow_reads,
    pack_attention_grads,
    prefetch,
    run_pass,
    update_on_arrival,
)
from fsg._src.passes.float8 import matmuls as float8
from fsg._src.passes.options import DEFAULT, Fusions
from fsg._src.trace import markers


class Options(NamedTuple):
    """What the passes are told about the step, as data."""

    adamw: fuse_adamw.AdamWPlan | None = None  # replace the traced AdamW update by the fused kernel
    on_mesh: bool = False  # a per-rank graph with collectives
    bucket_mb: float | None = None  # bucket and place the collectives (on a mesh)
    num_state_leaves: int | None = None  # stage 1's leaf layout: the inputs after these are the batch
    float8: float8.Float8Plan | None = None  # Policy(matmul=fsg.Float8()): the linear layers' matmuls in FP8
    fusions: Fusions = DEFAULT  # which fused kernels the passes may put in (compile_step(fusions=...))

    @property
    def bucketing(self) -> bool:
        return self.on_mesh and bool(self.bucket_mb)


class Pass(NamedTuple):
    """A pass: its name, how to run it, when it applies, and the passes it must follow."""

    name: str
    run: Callable[[fx.GraphModule, Options], Any]
    applies: Callable[[Options], bool]
    after: tuple[str, ...] = ()


PASSES = (
    # attention's backward writes the qkv gradient in place of a concatenation (a rank's local
    # rewrite, so also on a mesh; before float8, which then casts the packed gradient)
    Pass(
        "pack_attention_grads",
        lambda gm, o: pack_attention_grads.pack_attention_grads(gm, o.fusions),
        lambda o: o.fusions.pack_attention_grads,
    ),
    # reads the parameters' names off their inputs, before the gathers are packed (on a mesh)
    Pass(
        "float8",
        lambda gm, o: float8.rewrite(gm, o.float8, o.fusions),
        lambda o: o.float8 is not None,
        after=("pack_attention_grads",),
    ),
    # finds the gradients by their fsg::grad markers, and the update by the donation copy_s
    Pass("fuse_adamw", lambda gm, o: fuse_adamw.fuse_adamw(gm, o.adamw), lambda o: o.adamw is not None),
    Pass("strip_markers", lambda gm, o: markers.strip(gm), lambda o: o.adamw is not None, after=("fuse_adamw",)),
    # the global norm reads bf16 gradients, not float32 casts of them (one device: no mesh)
    Pass("narrow_reads", lambda gm, o: narrow_reads.narrow_reads(gm), lambda o: not o.on_mesh, after=("fuse_adamw",)),
    # an MLP's tanh GELU and its gradient in cuBLASLt's GEMM epilogues (a rank's local rewrite,
    # so also on a mesh; after float8, which takes the matmuls it converts and their GELUs first)
    Pass(
        "gemm_epilogues",
        lambda gm, o: gemm_epilogues.gemm_epilogues(gm, o.fusions),
        lambda o: o.fusions.gemm_epilogues,
        after=("float8",),
    ),
    # the parameters' casts to the compute dtype in one launch (a rank's local rewrite, so also
    # on a mesh; after the passes that match a matmul's or GELU's operands, which then read
    # views of its buffer, and before the gathers are packed)
    Pass(
        "batch_casts",
        lambda gm, o: batch_casts.batch_casts(gm, o.fusions),
        lambda o: o.fusions.batch_casts,
        after=("float8", "fuse_adamw", "narrow_reads", "gemm_epilogues"),
    ),
    # the gathers' buckets first: they fix where the forward reads each parameter
    Pass(
        "bucket_parameter_gathers",
        lambda gm, o: prefetch.bucket_parameter_gathers(gm, o.bucket_mb),
        lambda o: o.bucketing,
        after=("float8", "strip_markers"),
    ),
    Pass(
        "bucket_gradient_collectives",
        lambda gm, o: buckets.bucket_gradient_collectives(gm, o.bucket_mb),
        lambda o: o.bucketing,
        after=("fuse_adamw", "strip_markers", "bucket_parameter_gathers"),
    ),
    # splits the fused node per bucket: needs both the node and the buckets' waits
    Pass(
        "update_on_arrival",
        lambda gm, o: update_on_arrival.update_on_arrival(gm),
        lambda o: o.bucketing and o.adamw is not None,
        after=("fuse_adamw", "bucket_gradient_collectives"),
    ),
    # moves what is left of the forward's small collectives, around the buckets' final places
    Pass(
        "defer_small_collectives",
        lambda gm, o: defer.defer_small_collectives(gm, o.num_state_leaves),
        lambda o: o.on_mesh and bool(o.bucket_mb),
        after=("bucket_gradient_collectives", "update_on_arrival"),
    ),
)


def order(passes: tuple[Pass, ...] | list[Pass]) -> list[Pass]:
    """``passes`` sorted so that each comes after every pass it names in ``after`` (when that
    pass is in the list), in declaration order otherwise. Raises ``ValueError`` for a name that
    no pass has or a cycle."""
    names = {p.name for p in passes}
    known = {p.name for p in PASSES} | names
    for p in passes:
        unknown = [a for a in p.after if a not in known]
        if unknown:
            raise ValueError(f"pass {p.name} must follow {unknown}, which no pass is called")
    done: list[Pass] = []
    pending = list(passes)
    while pending:
        ready = next((p for p in pending if all(a not in names or a in {d.name for d in done} for a in p.after)), None)
        if ready is None:
            raise ValueError(f"the passes {[p.name for p in pending]} wait for each other (a cycle in `after`)")
        done.append(ready)
        pending.remove(ready)
    return done


def run(gm: fx.GraphModule, options: Options, passes: tuple[Pass, ...] = PASSES) -> tuple[fx.GraphModule, dict]:
    """Runs the passes that apply, in ``order``, on a copy of ``gm``; returns the rewritten
    copy (``gm`` itself when no pass applies) and each pass's result by name."""
    chosen = order([p for p in passes if p.applies(options)])
    if not chosen:
        return gm, {}
    out = _torch_private.copy_graph_module(gm)
    return out, {p.name: run_pass(p.name, p.run, out, options) for p in chosen}
