"""``compile_step`` and the ``Step`` it returns: trace once, compile, replay.

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

from fsg._src import backend as backend_lib
from fsg._src import cudagraph, overlap, placement, tree
from fsg._src import trace as trace_lib
from fsg._src import verify as verify_lib
from fsg._src.build import Builder, Built
from fsg._src.errors import (
    RecompileError,
    RecompileWarning,
    UnsupportedError,
)
from fsg._src.mesh import Mesh, P
from fsg._src.optim._base import GradientTransformation, device_of
from fsg._src.precision import Policy, check_policy
from fsg._src.sharding import Rules
from fsg._src.signature import Signature, describe_change, structure_error
from fsg._src.stages import Lowered
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
        fused_optimizer: bool | None = None,
        cuda_graph: bool | None = None,
        bucket_mb: float | None = overlap.DEFAULT_BUCKET_MB,
        verify: bool = False,
    ):
        backend_lib.check_backend(backend)
        # what variant() rebuilds the step from
        self._config = dict(
            loss_fn=loss_fn, optimizer=optimizer, backend=backend, donate=donate, strict=strict, mesh=mesh,
            param_sharding=param_sharding, batch_sharding=batch_sharding, precision=precision,
            accum_steps=accum_steps, fused_optimizer=fused_optimizer, cuda_graph=cuda_graph, bucket_mb=bucket_mb,
        )  # fmt: skip
        self._declared_mesh = mesh  # specs are checked against it even when it spans one device
        self._cuda_graph = cuda_graph
        self._precision = check_policy(precision or Policy())
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
            mesh=self._mesh,
            batch_sharding=batch_sharding,
            fused_optimizer=fused_optimizer,
            bucket_mb=bucket_mb,
        )
        self._backend = backend
        self._donate = donate
        self._strict = strict
        self._cache: dict[Signature, Built] = {}
        self._structure: tuple[optree.PyTreeSpec, optree.PyTreeSpec] | None = None
        self._last_signature: Signature | None = None
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
        config.update(fused_optimizer=False, cuda_graph=False, **changes)
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
            ``loss_fn`` is called as ``loss_fn(params, batch, buffers)``.

        Returns:
          ``TrainState(step=0, params, opt_state=optimizer.init(params), rng, buffers)``. On
          a mesh every leaf is a ``DTensor`` placed by ``param_sharding`` (optimizer state
          follows its parameter; scalars are replicated), and each rank holds only its shards.
        """
        tree.check_tensor_leaves(params, "params")
        params = self._precision.cast_param(tree.tree_map(lambda p: p.detach().clone(), params))
        buffers = {} if buffers is None else tree.tree_map(lambda b: b.detach().clone(), buffers)
        tree.check_tensor_leaves(buffers, "buffers")
        if self._mesh is not None:
            params = placement.distribute_params(params, self._mesh, self._param_sharding)
        elif self._declared_mesh is not None:  # one device: the specs are checked all the same
            placement.check_param_specs(params, self._declared_mesh, self._param_sharding)
        device = device_of(params)
        state = TrainState(
            step=torch.zeros((), dtype=torch.int64, device=device),
            params=params,
            opt_state=self._optimizer.init(params),  # on DTensor params: states take their placements
            rng=torch.tensor([seed, 0], dtype=torch.int64, device=device),
            buffers=buffers,
        )
        return state if self._mesh is None else placement.replicate_rest(state, self._mesh)

    def _signature(self, state: Any, batch: Any) -> tuple[Signature, list, list]:
        state_leaves, state_def = tree.flatten(state)
        batch_leaves, batch_def = tree.flatten(batch)
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
        if not all(isinstance(leaf, torch.Tensor) for leaf in batch_leaves):
            tree.check_tensor_leaves(batch, "batch")
        signature = Signature(state_def, batch_def, state_specs, tree.leaf_specs(batch_leaves))
        return signature, state_leaves, batch_leaves

    def _graph_replay(self, state: Any, batch: Any) -> bool:
        """Whether the compiled step is replayed as a CUDA graph: by default whenever it can
        be on one device (donated state, everything on CUDA); ``cuda_graph=True`` insists, and
        also replays a step on a mesh, collectives included (experimental)."""
        if self._cuda_graph is False:
            return False
        reason = None
        if self._mesh is not None and self._cuda_graph is None:
            # Experimental: replaying NCCL collectives inside a graph works, but is opt-in.
            reason = "the step runs on a mesh (replay with collectives is opt-in: cuda_graph=True)"
        elif not self._donate:
            reason = "donate=False (replay needs the state in fixed buffers)"
        elif not cudagraph.can_graph([*tree.flatten(state)[0], *tree.flatten(batch)[0]]):
            reason = "some state or batch leaf is not a CUDA tensor"
        if self._cuda_graph and reason is not None:
            raise UnsupportedError(f"cuda_graph=True, but {reason}; pass cuda_graph=None or False")
        return reason is None

    def _compile(self, signature: Signature, state: Any, batch: Any) -> Built:
        if self._last_signature is not None:
            change = describe_change(self._last_signature, signature, state, batch)
            message = (
                f"fsg: the step's abstract signature changed ({change}); tracing and compiling "
                f"it again (compile #{self.num_compiles + 1}). Keep shapes fixed (pad the last "
                f"batch, or drop it) to avoid recompiles."
            )
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
        built = self._builder.build(state, batch)
        fn = backend_lib.compile_graph(built.graph, self._backend)
        if self._graph_replay(state, batch):
            fn = cudagraph.GraphedStep(fn, built.traced.num_state_leaves, strict=bool(self._cuda_graph))
        compiled = built._replace(fn=fn)
        self._cache[signature] = compiled
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
          sync): ``loss``, ``grad_norm``, ``lr`` and the aux outputs of ``loss_fn``.
        """
        if self._verify_pending:
            self._verify_pending = False
            return verify_lib.verify_step(self, state, batch)
        signature, state_leaves, batch_leaves = self._signature(state, batch)
        compiled = self._cache.get(signature)
        if compiled is None:
            compiled = self._compile(signature, state, batch)
        self._last_signature = signature
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
        return new_state, metrics

    def lower(self, state: TrainState, batch: Any) -> Lowered:
        """The traced step graph for this state and batch, for inspection (nothing runs)."""
        signature, state_leaves, batch_leaves = self._signature(state, batch)
        built = self._cache.get(signature) or self._builder.build(state, batch)
        inputs = [*state_leaves, *batch_leaves]
        if built.plan is not None:
            inputs = [t.to_local() for t in state_leaves] + placement.local_batch(
                batch_leaves, built.plan.batch_placements, self._mesh
            )
        return Lowered(built.graph, inputs, global_graph=built.traced.graph_module, mesh=self._mesh)


def compile_step(
    loss_fn: LossFn,
    mesh: Mesh | None = None,
    *,
    optimizer: GradientTransformation,
    param_sharding: Rules | None = None,
    batch_sharding: P | None = None,
    precision: Policy | None = None,
    accum_steps: int = 1,
    backend: str = "inductor",
    donate: bool = True,
    strict: bool = False,
    fused_optimizer: bool | None = None,
    cuda_graph: bool | None = None,
    bucket_mb: float | None = 25.0,
    verify: bool = False,
) -> Step:
    """Compiles the whole train step of ``loss_fn`` (forward, backward, optimizer) into one graph.

    Tracing happens at the first call, on the abstract values (shapes, dtypes) of the state
    and batch; later calls with the same signature replay the compiled graph. A new signature
    traces and compiles again, with a ``RecompileWarning`` naming the leaf that changed.

    ``loss_fn`` has global semantics (as under ``jax.jit``): it is written as if everything
    lived on one device; the mesh and specs change where work runs and which collectives are
    issued, not the result.

    Args:
      loss_fn: a pure ``loss_fn(params, batch)`` returning a 0-d loss tensor or
        ``(loss, aux)`` with ``aux`` a dict of tensors (reported as metrics). It may not
        mutate its inputs nor read tensor values on the host (``.item()``, ``if x > 0``).
      mesh: an ``fsg.Mesh``; ``None`` (or a mesh of size 1) runs on one device.
      optimizer: a ``fsg.optim.GradientTransformation``.
      param_sharding: ``fsg.sharding`` rules giving each parameter's spec; default replicated.
      batch_sharding: the spec of every batch leaf; default ``P("dp")`` (dim 0 over the
        ``dp`` axis) when the mesh has a ``dp`` axis. The axes it names are the data axes.
        Pass batches as global tensors (each rank keeps its slice) or as DTensors.
      precision: an ``fsg.Policy``: the dtype params and optimizer state live in, and the
        dtype the loss computes in (default: float32 for both).
      accum_steps: split each batch into this many microbatches along dim 0 and average
        their gradients, loss and aux in the one graph (gradient accumulation).
      backend: ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"`` (no compiler).
      donate: update the state in place (no second copy of params and optimizer state);
        the state passed in is returned, updated.
      strict: raise ``RecompileError`` instead of recompiling when the signature changes.
      fused_optimizer: replace the traced ``fsg.optim.adamw`` update by the fused Triton
        kernel (one launch per dtype group, in place; on a mesh each rank updates its own
        pieces after the gradient reductions). ``None`` (default): on CUDA, when the optimizer
        is ``adamw`` or ``adam`` and ``donate=True``; ``True``: always (also
        on CPU, under ``TRITON_INTERPRET=1`` or via its eager reference), raising if it
        cannot; ``False``: never.
      cuda_graph: replay the whole compiled step as one CUDA graph from its third call on
        (call 1 compiles, call 2 warms up and captures). ``None`` (default): whenever the
        state and batch are on CUDA, on one device, with ``donate=True``; ``True``: raise if
        it cannot, and replay on a mesh too, NCCL collectives inside the graph
        (experimental); ``False``: never. The batch is copied into the graph's own buffers; a
        state in other storages (a restored checkpoint) is captured again.
      bucket_mb: on a mesh, pack gradient all-reduces (and FSDP's reduce-scatters) into
        buckets of at most this many MiB and issue each as soon as its last gradient is
        computed, so that reductions overlap the rest of the backward (as DDP's
        ``bucket_cap_mb``); FSDP's parameter all-gathers are packed the same way and each
        bucket is gathered while the previous one's layers compute. ``None`` or 0: one
        collective per tensor, where stage 2 placed it.
      verify: on a mesh, check the first step against the unsharded step before running it
        (``fsg.testing.verify_step``: both in float64, every metric and state leaf compared)
        and raise ``fsg.VerificationError`` naming the first leaf that differs. Costs two
        extra traces at the first call; nothing after.

    Returns:
      A ``Step``: ``state = step.init(params)``, then ``state, metrics = step(state, batch)``.

    Example:
      >>> model = torch.nn.Linear(4, 1)
      >>> def loss_fn(params, batch):
      ...     return ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()
      >>> step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(1e-2), backend="aot_eager")
      >>> state = step.init(fsg.params(model))
      >>> state, metrics = step(state, {"x": torch.randn(8, 4), "y": torch.randn(8, 1)})
      >>> sorted(metrics)
      ['grad_norm', 'loss', 'lr']
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"compile_step: mesh must be an fsg.Mesh or None, got {type(mesh).__name__}")
    return Step(
        loss_fn,
        optimizer,
        backend=backend,
        donate=donate,
        strict=strict,
        mesh=mesh,
        param_sharding=param_sharding,
        batch_sharding=batch_sharding,
        precision=precision,
        accum_steps=accum_steps,
        fused_optimizer=fused_optimizer,
        cuda_graph=cuda_graph,
        bucket_mb=bucket_mb,
        verify=verify,
    )
