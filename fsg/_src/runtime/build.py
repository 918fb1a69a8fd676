"""Stages 1-3 of a step: trace (stage 1), shard into a per-rank graph (stage 2, on a mesh)
and the graph passes (stage 3: the fused AdamW, gradient buckets, per-bucket updates).
``Step`` (step.py) compiles what this returns (stage 4), caches it per signature and runs it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Any, NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fsg._src import _torch_private, tree
from fsg._src.errors import ShardingRuleError, UnsupportedError
from fsg._src.kernels._common import plain_math
from fsg._src.mesh import Mesh, P
from fsg._src.optim._base import GradientTransformation
from fsg._src.passes import buckets, defer, prefetch, run_pass
from fsg._src.passes import fuse_adamw as fusion
from fsg._src.precision import Policy
from fsg._src.sharding import op_support, placement, spmd
from fsg._src.trace import markers, purity
from fsg._src.trace import tracing as trace_lib

log = logging.getLogger("fsg")


class Built(NamedTuple):
    traced: trace_lib.TracedStep  # stage 1: the global graph
    graph: Any  # the graph to compile: stage 1's, or stage 2's local graph on a mesh
    fn: Any  # stage 4: the compiled callable (set by Step)
    plan: spmd.ShardPlan | None


class Builder:
    """What a step is built from; ``build(state, batch)`` runs stages 1-3."""

    def __init__(
        self,
        loss_fn: trace_lib.LossFn,
        optimizer: GradientTransformation,
        *,
        donate: bool,
        precision: Policy,
        accum_steps: int,
        mesh: Mesh | None,
        batch_sharding: P,
        fused_optimizer: bool | None,
        bucket_mb: float | None,
    ):
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._donate = donate
        self._precision = precision
        self._accum_steps = accum_steps
        self._mesh = mesh
        self._batch_sharding = batch_sharding
        self._fused_optimizer = fused_optimizer
        self._bucket_mb = bucket_mb

    def build(self, state: Any, batch: Any) -> Built:
        """Stages 1 (trace), 2 (shard, on a mesh) and 3 (graph passes) for this state and
        batch. When the fused AdamW kernel will replace the optimizer update, stage 1 traces
        a stand-in for the update's math (``fusion.stand_in``); should the fusion pass then
        refuse the graph, everything is traced again with the real math."""
        build = self._local if self._mesh is None else self._mesh_build
        fuse = self.fuse_optimizer(state)
        built = build(state, batch, fusion.stand_in(self._optimizer) if fuse else self._optimizer, fuse)
        # stage 3; run_pass checks each pass's invariants under FSG_CHECK_PASSES=1
        if fuse:
            try:
                run_pass("fuse_adamw", fusion.fuse_adamw, built.graph, state, self._optimizer)
                run_pass("strip_markers", markers.strip, built.graph)
            except UnsupportedError:
                if self._fused_optimizer:  # asked for; by default the traced math runs
                    raise
                built, fuse = build(state, batch, self._optimizer, False), False
        if self._mesh is not None and self._bucket_mb:  # bucket and place the collectives
            run_pass("bucket_parameter_gathers", prefetch.bucket_parameter_gathers, built.graph, self._bucket_mb)
            run_pass("bucket_gradient_collectives", buckets.bucket_gradient_collectives, built.graph, self._bucket_mb)
            if fuse:  # update each bucket's params as soon as its reduction lands
                run_pass("update_on_arrival", fusion.update_on_arrival, built.graph)
            run_pass("defer_small_collectives", defer.defer_small_collectives, built.graph)
        return built

    def _local(self, state: Any, batch: Any, optimizer: GradientTransformation, mark_grads: bool) -> Built:
        """Stage 1 on one device (``mark_grads``: for the fusion pass, which finds the
        gradients by their markers)."""
        t0 = time.perf_counter()
        traced = trace_lib.trace(
            self._loss_fn,
            optimizer,
            state,
            batch,
            donate=self._donate,
            precision=self._precision,
            accum_steps=self._accum_steps,
            mark_grads=mark_grads,
        )
        n = len(traced.graph_module.graph.nodes)
        log.info("fsg: stage 1: traced the step (%d graph nodes) in %.1f s", n, time.perf_counter() - t0)
        return Built(traced, traced.graph_module, None, None)

    def _mesh_build(self, state: Any, batch: Any, optimizer: GradientTransformation, mark_grads: bool) -> Built:
        plan = placement.make_plan(state, batch, self._batch_sharding, self._mesh)
        state_leaves, state_def = tree.flatten(state)
        batch_leaves, batch_def = tree.flatten(batch)
        mode = _torch_private.fake_mode()
        with mode:  # global-shaped stand-ins: stage 1 never allocates the global state
            fakes = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in [*state_leaves, *batch_leaves]]
        n = len(state_leaves)
        # DTensor has sharding rules for the CUDA attention kernels but not the CPU one: on
        # CPU, attention is traced as its math (bmm, softmax), which it can shard.
        math_attention = self._mesh.device_type == "cpu"
        attention = sdpa_kernel([SDPBackend.MATH]) if math_attention else contextlib.nullcontext()
        t0 = time.perf_counter()
        with attention, plain_math():  # DTensor shards torch ops, not fsg's opaque kernels
            traced = trace_lib.trace(
                self._loss_fn,
                optimizer,
                tree.unflatten(state_def, fakes[:n]),
                tree.unflatten(batch_def, fakes[n:]),
                donate=self._donate,
                precision=self._precision,
                accum_steps=self._accum_steps,
                mark_uses=True,
                mark_grads=True,
                source_lines=True,  # stage 2's errors name the user's line
                decompositions=op_support.mesh_decompositions(),  # only ops with verified rules reach stage 2
            )
        n_global = len(traced.graph_module.graph.nodes)
        log.info("fsg: stage 1: traced the step (%d graph nodes) in %.1f s", n_global, time.perf_counter() - t0)
        t0 = time.perf_counter()
        local_inputs = [t.to_local() for t in state_leaves] + placement.local_batch(
            batch_leaves, plan.batch_placements, self._mesh
        )
        try:
            local = spmd.expand(
                traced,
                plan,
                [tuple(t.shape) for t in state_leaves],
                [tuple(t.shape) for t in batch_leaves],
                local_inputs,
                mark_grads=mark_grads,
                reduce_dtype=self._precision.reduce,
            )
        except ShardingRuleError as exc:
            where = purity.locate(self._loss_fn, state.params, batch, state.buffers, exc.op)
            if where is None:
                raise
            raise ShardingRuleError(re.sub(r" at graph node \S+,", f" at {where},", str(exc)), op=exc.op) from exc
        n_local = len(local.graph.nodes)
        log.info("fsg: stage 2: per-rank graph (%d nodes) in %.1f s", n_local, time.perf_counter() - t0)
        return Built(traced, local, None, plan)

    def fuse_optimizer(self, state: Any) -> bool:
        """Whether stage 3 swaps in the fused AdamW kernel: by default on CUDA whenever it
        applies; ``fused_optimizer=True`` insists (and says why it cannot), ``False`` never."""
        if self._fused_optimizer is False:
            return False
        reason = fusion.why_not_fusable(self._optimizer, state, donate=self._donate)
        if self._fused_optimizer and reason is not None:
            raise UnsupportedError(f"fused_optimizer=True, but {reason}; pass fused_optimizer=None or False")
        return reason is None and (self._fused_optimizer or state.step.is_cuda)
