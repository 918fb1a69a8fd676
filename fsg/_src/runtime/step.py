"""The ``Step`` that ``compile_step`` returns: trace once, compile, replay.

``Step.__call__`` is the hot path: it flattens state and batch with optree (C++), checks the
batch's abstract signature, and replays the compiled graph. The state's signature is only
recomputed when its leaves are not the very tensors the previous call returned. Stages 1-3
(trace, shard, graph passes) are in build.py; this module compiles their graph (stage 4) and
caches it per signature.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import optree
import torch

from fsg._src import tree, watch
from fsg._src.backend import cudagraph
from fsg._src.backend import inductor as backend_lib
from fsg._src.errors import (
    ArgumentError,
    RecompileError,
    RecompileWarning,
)
from fsg._src.mesh import Mesh, P
from fsg._src.optim._base import GradientTransformation, device_of
from fsg._src.optim._complex import real_views
from fsg._src.passes import buckets
from fsg._src.passes.options import DEFAULT, Fusions
from fsg._src.precision import Policy, check_policy
from fsg._src.rules import Rules
from fsg._src.runtime import nonfinite, replicas, validate
from fsg._src.runtime import verify as verify_lib
from fsg._src.runtime.build import Builder, Built
from fsg._src.runtime.lowered import Lowered
from fsg._src.runtime.signature import Signature, describe_change, structure_error
from fsg._src.sharding import placement
from fsg._src.trace import resilience
from fsg._src.trace import tracing as trace_lib
from fsg._src.train_state import TrainState

LossFn = trace_lib.LossFn


class Step:
    """A compiled train step: ``state, metrics = step(state, batch)``.

    Made by ``fsg.compile_step``; see there for the arguments.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: GradientTransformation,
        *,
        backend: str,
        donate: bool,
        strict: bool,
        mesh: Mesh | None = None,
        param_sharding: Rules | None = None,
        batch_sharding: P | None = None,
        precision: Policy | None = None,
        accum_steps: int = 1,
        microbatch_weight: Any = None,
        fused_optimizer: bool | None = None,
        cuda_graph: bool | None = None,
        bucket_mb: float | None = buckets.DEFAULT_BUCKET_MB,
        verify: bool = False,
        skip_nonfinite: bool | nonfinite.SkipNonFinite | None = None,
        check_replicas: int | None = None,
        fused_loss: bool | None = None,
        fusions: Fusions = DEFAULT,
    ):
        backend_lib.check_backend(backend)
        # what variant() rebuilds the step from
        self._precision = check_policy(precision or Policy())
        self._config = dict(
            loss_fn=loss_fn, optimizer=optimizer, backend=backend, donate=donate, strict=strict, mesh=mesh,
            param_sharding=param_sharding, batch_sharding=batch_sharding, precision=precision,
            accum_steps=accum_steps, microbatch_weight=microbatch_weight, fused_optimizer=fused_optimizer,
            cuda_graph=cuda_graph, bucket_mb=bucket_mb,
            skip_nonfinite=skip_nonfinite, check_replicas=check_replicas, fused_loss=fused_loss, fusions=fusions,
        )  # fmt: skip
        skip, skip_policy = nonfinite.resolve(skip_nonfinite)
        self._watchdog = nonfinite.Watchdog(skip_policy)
        self._replica_check = replicas.ReplicaCheck(check_replicas)  # every N calls: docs/resilience.md
        if skip is False and self._precision.loss_scale is not None:  # precision is checked above
            raise ArgumentError("compile_step(skip_nonfinite=False) contradicts the Policy's float16 loss scale, which "
                                "skips the steps that overflow; drop skip_nonfinite=False, or pass loss_scale=False")  # fmt: skip
        self._declared_mesh = mesh  # specs are checked against it even when it spans one device
        self._cuda_graph = cuda_graph
        self._mesh = mesh if mesh is not None and mesh.size > 1 else None
        self._param_sharding = param_sharding
        if batch_sharding is None:
            batch_sharding = P("dp") if mesh is not None and "dp" in mesh.axis_names else P()
        self._batch_sharding = batch_sharding
        self._verify_pending = verify and self._mesh is not None
        self._optimizer = optimizer
        self._builder = Builder(
            loss_fn,
            optimizer,
            donate=donate,
            precision=self._precision,
            accum_steps=accum_steps,
            microbatch_weight=microbatch_weight,
            mesh=self._mesh,
            batch_sharding=batch_sharding,
            fused_optimizer=fused_optimizer,
            bucket_mb=bucket_mb,
            skip=skip,
            fused_loss=fused_loss,
            fusions=fusions,
        )
        self._backend = backend
        self._donate = donate
        self._strict = strict
        self._cache: dict[tuple[Signature, Any], Built] = {}  # by signature and the modules' flags (watch.py)
        self._flags = watch.Flags()
        self._structure: tuple[optree.PyTreeSpec, optree.PyTreeSpec] | None = None
        self._last_key: tuple[Signature, Any] | None = None
        self._last_state_leaves: list[torch.Tensor] = []
        self._last_state_specs: tuple[tree.LeafSpec, ...] = ()

    @property
    def mesh(self) -> Mesh | None:
        """The mesh the step is sharded over (``None`` on one device, or a mesh of size 1)."""
        return self._mesh

    @property
    def precision(self) -> Policy:
        """The step's ``fsg.Policy``."""
        return self._precision

    def variant(self, **changes: Any) -> Step:
        """A new, uncompiled step with the same arguments but ``changes``, for checks that
        run a step another way (``fsg.testing.verify_step`` runs it unsharded, in float64,
        without a fused optimizer or CUDA-graph replay)."""
        config = {**self._config, "backend": "eager", "donate": False, "strict": False}
        config.update(fused_optimizer=False, cuda_graph=False, check_replicas=None, **changes)
        return Step(**config)

    @property
    def num_compiles(self) -> int:
        """How many times the step has been traced and compiled (one per signature seen)."""
        return len(self._cache)

    def init(self, params: Any, *, seed: int = 0, buffers: Any = None) -> TrainState:
        """Builds the initial ``TrainState`` for ``params``.

        The params are copied (the step updates its state in place when ``donate=True``, and
        must not write through to the module they came from).

        Args:
          params: the parameter pytree, e.g. ``fsg.params(model)``.
          seed: seeds the state's ``rng`` key.
          buffers: optional buffers (``fsg.buffers(model)``); when given and non-empty,
            ``loss_fn`` is called as ``loss_fn(params, batch, buffers)``. Those of a dtype the
            params are cast from (``Policy.param``) are cast with them.

        Returns:
          ``TrainState(step=0, params, opt_state=optimizer.init(params), rng, buffers, skips,
          loss_scale)`` (``loss_scale`` only under a Policy that scales the loss). On
          a mesh every leaf is a ``DTensor`` placed by ``param_sharding`` (optimizer state
          follows its parameter; scalars are replicated), and each rank holds only its shards.
        """
        validate.check_init(params, seed)
        buffers = {} if buffers is None else tree.tree_map(lambda b: b.detach().clone(), buffers)
        tree.check_tensor_leaves(buffers, "buffers")
        precision = self._precision.resolve(params)
        buffers = precision.cast_buffers(buffers, params)  # before the params are cast: their dtypes
        params = precision.cast_param(tree.tree_map(lambda p: p.detach().clone(), params))
        if self._mesh is not None:
            params = placement.distribute_params(params, self._mesh, self._param_sharding)
        elif self._declared_mesh is not None:  # one device: the specs are checked all the same
            placement.check_param_specs(params, self._declared_mesh, self._param_sharding)
        device = device_of(params)
        state = TrainState(
            step=torch.zeros((), dtype=torch.int64, device=device),
            params=params,
            opt_state=self._optimizer.init(real_views(params)),  # DTensor params: states take their placements
            rng=torch.tensor([seed, 0], dtype=torch.int64, device=device),
            buffers=buffers,
            skips=resilience.initial_skips(device),
            loss_scale=resilience.initial_loss_scale(self._precision.loss_scale, device),
        )
        return state if self._mesh is None else placement.replicate_rest(state, self._mesh)

    def _signature(self, state: Any, batch: Any) -> tuple[Signature, list, list]:
        state_leaves, state_def = tree.flatten(state)
        batch_leaves, batch_def = tree.flatten(batch)
        mapping_inside = not all(isinstance(leaf, torch.Tensor) for leaf in batch_leaves)
        if mapping_inside and tree.check_tensor_leaves(batch, "batch"):
            batch_leaves, batch_def = tree.flatten(batch)  # a mapping inside, seen for the first time: now a node
        if self._structure is not None:
            if state_def != self._structure[0]:
                raise structure_error("state", self._structure[0], state)
            if batch_def != self._structure[1]:
                raise structure_error("batch", self._structure[1], batch)
        if len(state_leaves) == len(self._last_state_leaves) and all(
            map(operator.is_, state_leaves, self._last_state_leaves)
        ):
            state_specs = self._last_state_specs
        else:
            tree.check_tensor_leaves(state, "state")
            state_specs = tree.leaf_specs(state_leaves)
        signature = Signature(state_def, batch_def, state_specs, tree.leaf_specs(batch_leaves))
        return signature, state_leaves, batch_leaves

    def _compile(self, key: tuple[Signature, Any], state: Any, batch: Any) -> Built:
        signature, flags = key
        if self._last_key is not None:
            old, old_flags = self._last_key
            if old != signature:
                what = f"the step's abstract signature changed ({describe_change(old, signature, state, batch)})"
                hint = "Keep shapes fixed (pad the last batch, or drop it) to avoid recompiles."
            else:  # model.train()/eval(), requires_grad_(): read when a step is traced, as eager reads them
                what = f"a module flag the step was traced with changed ({self._flags.describe(old_flags, flags)})"
                hint = "The graph for each setting stays cached: switching back does not trace again."
            message = f"fsg: {what}; tracing and compiling it again (compile #{self.num_compiles + 1}). {hint}"
            if self._strict:
                raise RecompileError(
                    message.replace("tracing and compiling it again", "strict=True forbids a recompile")
                )
            warnings.warn(message, RecompileWarning, stacklevel=3)
        if self._mesh is None and self._declared_mesh is not None:  # checked on a mesh by stage 2
            batch_leaves = tree.flatten(batch)[0]
            placement.batch_placements(
                batch_leaves, tree.leaf_paths(batch, "batch"), self._batch_sharding, self._declared_mesh
            )
        with watch.recording(self._flags):  # the modules' flags the trace reads: part of the key
            built = self._builder.build(state, batch)
        fn = backend_lib.compile_graph(built.graph, self._backend, self._config["fusions"])  # fixed for the step
        leaves = [*tree.flatten(state)[0], *tree.flatten(batch)[0]]
        if cudagraph.wanted(self._cuda_graph, on_mesh=self._mesh is not None, donate=self._donate, leaves=leaves):
            fn = cudagraph.GraphedStep(fn, built.traced.num_state_leaves, strict=bool(self._cuda_graph))
        compiled = built._replace(fn=fn)
        self._cache[(signature, self._flags.now())] = compiled
        self._structure = (signature.state_def, signature.batch_def)
        return compiled

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Runs one train step.

        Args:
          state: the current ``TrainState``. With ``donate=True`` it is updated in place and
            returned; do not keep references to its old values.
          batch: a pytree of tensors with the same structure at every call.

        Returns:
          ``(new_state, metrics)``; metrics are 0-d tensors on the state's device (no host
          sync): ``loss``, ``grad_norm``, ``lr``, ``skipped`` (when skipping) and ``loss_scale``
          (docs/resilience.md) and the aux outputs of ``loss_fn``.
        """
        if self._verify_pending:
            self._verify_pending = False
            return verify_lib.verify_step(self, state, batch)
        signature, state_leaves, batch_leaves = self._signature(state, batch)
        key = (signature, self._flags.now())  # model.train()/eval() or requires_grad changed: traced again
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(key, state, batch)
            key = (signature, self._flags.now())  # as cached: with the modules the trace ran
        self._last_key = key
        inputs = [*state_leaves, *batch_leaves]
        if compiled.plan is not None:
            inputs = [t.to_local() for t in state_leaves] + placement.local_batch(
                batch_leaves, compiled.plan.batch_placements, self._mesh
            )
        with torch.no_grad():
            outputs = compiled.fn(*inputs)
        names = compiled.traced.metric_names
        metrics = dict(zip(names, outputs[len(outputs) - len(names) :]))
        if self._donate:
            new_state, new_leaves = state, state_leaves
        else:
            new_leaves = list(outputs[: compiled.traced.num_state_leaves])
            if compiled.plan is not None:
                new_leaves = placement.wrap_local(new_leaves, state_leaves, self._mesh)
            new_state = tree.unflatten(signature.state_def, new_leaves)
        self._last_state_leaves = new_leaves
        self._last_state_specs = signature.state_specs
        if "skipped" in names:  # every check_every calls: too many non-finite steps in a row?
            self._watchdog.after_step(new_state)
        self._replica_check.after_step(new_state)  # every check_replicas calls: do replicas agree?
        return new_state, metrics

    def lower(self, state: TrainState, batch: Any) -> Lowered:
        """The traced step graph for this state and batch, for inspection (nothing runs)."""
        signature, state_leaves, batch_leaves = self._signature(state, batch)
        built = self._cache.get((signature, self._flags.now())) or self._builder.build(state, batch)
        inputs = [*state_leaves, *batch_leaves]
        if built.plan is not None:
            inputs = [t.to_local() for t in state_leaves] + placement.local_batch(
                batch_leaves, built.plan.batch_placements, self._mesh
            )
        return Lowered(
            built.graph, inputs, global_graph=built.traced.graph_module, mesh=self._mesh, stages=built.stages
        )
