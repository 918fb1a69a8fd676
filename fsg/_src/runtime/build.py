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
from fsg._src.passes import fuse_adamw as fusion
from fsg._src.passes import pipeline
from fsg._src.passes.float8 import matmuls as float8
from fsg._src.passes.options import DEFAULT, Fusions
from fsg._src.precision import Policy
from fsg._src.runtime import validate
from fsg._src.sharding import op_support, placement, spmd
from fsg._src.trace import fused_loss as fused_loss_lib
from fsg._src.trace import purity
from fsg._src.trace import tracing as trace_lib

log = logging.getLogger("fsg")


class Built(NamedTuple):
    traced: trace_lib.TracedStep  # stage 1: the global graph
    graph: Any  # stage 3's output, what stage 4 compiles
    fn: Any  # stage 4: the compiled callable (set by Step)
    plan: spmd.ShardPlan | None
    stages: dict[str, Any]  # each stage's graph by name: "traced", "sharded" (on a mesh), "optimized"


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
        microbatch_weight: Any,
        mesh: Mesh | None,
        batch_sharding: P,
        fused_optimizer: bool | None,
        bucket_mb: float | None,
        skip: bool | None = None,
        fused_loss: bool | None = None,
        fusions: Fusions = DEFAULT,
    ):
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._donate = donate
        self._precision = precision
        self._accum_steps = accum_steps
        self._microbatch_weight = microbatch_weight
        self._mesh = mesh
        self._batch_sharding = batch_sharding
        self._fused_optimizer = fused_optimizer
        self._bucket_mb = bucket_mb
        self._skip = skip
        self._fused_loss = fused_loss
        self._fusions = fusions

    def build(self, state: Any, batch: Any) -> Built:
        """Stages 1 (trace), 2 (shard, on a mesh) and 3 (graph passes, ``passes/pipeline.py``)
        for this state and batch. When the fused AdamW kernel will replace the optimizer
        update, stage 1 traces a stand-in for the update's math (``fuse_adamw.stand_in``);
        should the fusion pass then refuse the graph, it says why in the log and everything is
        traced again with the real math."""
        validate.check_inputs(self._loss_fn, self._optimizer, state, batch)
        build = self._local if self._mesh is None else self._mesh_build
        adamw = self.fusion_plan(state)
        self._skip_now = self.skips(adamw is not None)
        graph = build(
            state, batch, self._optimizer if adamw is None else fusion.stand_in(adamw.spec), adamw is not None
        )
        on_mesh = self._mesh is not None
        fp8 = float8.plan(self._precision.matmul, state, graph.traced, shard_plan=graph.plan)
        try:
            return self._optimize(graph, self._options(adamw, on_mesh, graph, fp8))
        except UnsupportedError as exc:
            if adamw is None or self._fused_optimizer:  # asked for the fused kernel: no fallback
                raise
            log.warning("fsg: stage 3: the fused AdamW refused this step (%s); tracing the update's math instead", exc)
        graph = build(state, batch, self._optimizer, False)
        return self._optimize(graph, self._options(None, on_mesh, graph, fp8))

    def _options(self, adamw: Any, on_mesh: bool, built: Built, fp8: Any) -> pipeline.Options:
        n = built.traced.num_state_leaves
        return pipeline.Options(adamw, on_mesh, self._bucket_mb, n, fp8, self._fusions)

    def _optimize(self, built: Built, options: pipeline.Options) -> Built:
        t0 = time.perf_counter()
        graph, results = pipeline.run(built.graph, options)
        if results:
            log.info(
                "fsg: stage 3: %s in %.1f s",
                ", ".join(f"{k} ({v})" for k, v in results.items()),
                time.perf_counter() - t0,
            )
        return built._replace(graph=graph, stages={**built.stages, "optimized": graph})

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
            microbatch_weight=self._microbatch_weight,
            mark_grads=mark_grads,
            skip=self._skip_now,
            fused_loss=fused_loss_lib.wanted(self._fused_loss, state),
        )
        n = len(traced.graph_module.graph.nodes)
        log.info("fsg: stage 1: traced the step (%d graph nodes) in %.1f s", n, time.perf_counter() - t0)
        return Built(traced, traced.graph_module, None, None, {"traced": traced.graph_module})

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
                microbatch_weight=self._microbatch_weight,
                mark_uses=True,
                mark_grads=True,
                source_lines=True,  # stage 2's errors name the user's line
                decompositions=op_support.mesh_decompositions(),  # only ops with verified rules reach stage 2
                skip=self._skip_now,
                fused_loss=fused_loss_lib.wanted(self._fused_loss, state),
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
            raise ShardingRuleError(
                re.sub(r" at (graph node \S+|\(source line unknown\)),", f" at {where},", str(exc)), op=exc.op
            ) from exc
        n_local = len(local.graph.nodes)
        log.info("fsg: stage 2: per-rank graph (%d nodes) in %.1f s", n_local, time.perf_counter() - t0)
        return Built(traced, local, None, plan, {"traced": traced.graph_module, "sharded": local})

    def skips(self, fused: bool) -> bool:
        """Whether the step skips non-finite steps: when asked (off by default, as optax's
        ``apply_if_finite``; docs/resilience.md), and always under a loss scale. ``fused``: whether
        the fused AdamW applies (on a mesh, a skip waits for every gradient's norm, which
        costs the per-bucket update its overlap)."""
        del fused  # the cost is the user's choice now; docs/resilience.md says it
        return self._precision.loss_scale is not None or bool(self._skip)

    def fusion_plan(self, state: Any) -> fusion.AdamWPlan | None:
        """The fused AdamW's plan when stage 3 will swap in the kernel: by default on CUDA
        whenever it applies; ``fused_optimizer=True`` insists (and says why it cannot),
        ``False`` never."""
        if self._fused_optimizer is False:
            return None
        found = fusion.plan(self._optimizer, state, donate=self._donate)
        if isinstance(found, str):
            if self._fused_optimizer:
                raise UnsupportedError(f"fused_optimizer=True, but {found}; pass fused_optimizer=None or False")
            return None
        return found if self._fused_optimizer or state.step.is_cuda else None
