"""``fsg.compile_eval``: an evaluation step, compiled and cached like the train step.

Stage 1 (``trace/evaluation.py``) traces ``fn`` forward only, its modules in eval mode; on a
mesh stage 2 shards it as it shards a train step (FSDP gathers at each parameter read,
metrics replicated); stage 4 compiles it. Stage 3's passes rewrite gradients and updates,
which an evaluation has none of, so it skips them. The state is read, never written; the
train step's cache is untouched, so evaluating inside a training loop recompiles nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from fsg._src import _torch_private, checks, tree
from fsg._src.backend import inductor as backend_lib
from fsg._src.errors import MeshError, RecompileError, RecompileWarning
from fsg._src.kernels._common import plain_math
from fsg._src.mesh import Mesh, P
from fsg._src.precision import Policy, check_policy
from fsg._src.rules import Rules, param_names
from fsg._src.runtime.lowered import Lowered
from fsg._src.runtime.signature import Signature, describe_change, structure_error
from fsg._src.sharding import op_support, placement, spmd
from fsg._src.trace import evaluation
from fsg._src.trace import fused_loss as fused_loss_lib
from fsg._src.train_state import TrainState


class _Built(NamedTuple):
    traced: evaluation.TracedEval
    graph: Any  # what stage 4 compiles: the traced graph, or the per-rank graph on a mesh
    fn: Any
    plan: spmd.ShardPlan | None
    stages: dict[str, Any]


class EvalStep:
    """A compiled evaluation step: ``metrics = ev(state, batch)``. Made by ``fsg.compile_eval``."""

    def __init__(
        self,
        fn: evaluation.EvalFn,
        mesh: Mesh | None,
        *,
        param_sharding: Rules | None,
        batch_sharding: P | None,
        precision: Policy | None,
        backend: str,
        strict: bool,
        fused_loss: bool | None = None,
    ):
        backend_lib.check_backend(backend)
        self._fn = fn
        self._declared_mesh = mesh
        self._mesh = mesh if mesh is not None and mesh.size > 1 else None
        self._param_sharding = param_sharding
        if batch_sharding is None:
            batch_sharding = P("dp") if mesh is not None and "dp" in mesh.axis_names else P()
        self._batch_sharding = batch_sharding
        self._precision = check_policy(precision or Policy())
        self._backend = backend
        self._strict = strict
        self._fused_loss = fused_loss
        self._cache: dict[Signature, _Built] = {}
        self._last: Signature | None = None

    @property
    def num_compiles(self) -> int:
        """How many times the evaluation has been traced and compiled (one per signature)."""
        return len(self._cache)

    def __call__(self, state: TrainState, batch: Any) -> Any:
        """Evaluates ``fn`` on ``state.params`` (and ``state.buffers``) and ``batch``.

        Args:
          state: a ``TrainState`` (from ``step.init`` or the train step); read, never written.
          batch: a pytree of tensors, sharded on a mesh like the train step's batches.

        Returns:
          What ``fn`` returns, a tensor or a dict of tensors, on the state's device; on a
          mesh every rank holds the whole value (global semantics).
        """
        signature, state_leaves, batch_leaves = self._signature(state, batch)
        built = self._cache.get(signature)
        if built is None:
            built = self._compile(signature, state, batch)
        self._last = signature
        with torch.no_grad():
            outputs = built.fn(*self._inputs(built, state_leaves, batch_leaves))
        names = built.traced.step.metric_names
        return outputs[0] if built.traced.returns_tensor else dict(zip(names, outputs))

    def lower(self, state: TrainState, batch: Any) -> Lowered:
        """The evaluation's graphs for this state and batch, for inspection (nothing runs):
        ``as_text("traced")``, ``as_text("sharded")`` on a mesh, ``as_text()``."""
        signature, state_leaves, batch_leaves = self._signature(state, batch)
        built = self._cache.get(signature) or self._build(state, batch)
        inputs = self._inputs(built, state_leaves, batch_leaves)
        global_graph = built.traced.step.graph_module
        return Lowered(built.graph, inputs, global_graph=global_graph, mesh=self._mesh, stages=built.stages)

    def _inputs(self, built: _Built, state_leaves: list, batch_leaves: list) -> list[torch.Tensor]:
        if built.plan is None:
            return [*state_leaves, *batch_leaves]
        local = placement.local_batch(batch_leaves, built.plan.batch_placements, self._mesh)
        return [t.to_local() for t in state_leaves] + local

    def _signature(self, state: TrainState, batch: Any) -> tuple[Signature, list, list]:
        if not isinstance(state, TrainState):
            raise TypeError(f"an evaluation step takes a fsg.TrainState, got {type(state).__name__}")
        inputs = evaluation.eval_inputs(state)
        tree.check_tensor_leaves(inputs, "state")
        tree.check_tensor_leaves(batch, "batch")
        state_leaves, state_def = tree.flatten(inputs)
        batch_leaves, batch_def = tree.flatten(batch)
        if self._last is not None and state_def != self._last.state_def:
            raise structure_error("state", self._last.state_def, inputs)
        if self._last is not None and batch_def != self._last.batch_def:
            raise structure_error("batch", self._last.batch_def, batch)
        specs = (tree.leaf_specs(state_leaves), tree.leaf_specs(batch_leaves))
        return Signature(state_def, batch_def, *specs), state_leaves, batch_leaves

    def _compile(self, signature: Signature, state: TrainState, batch: Any) -> _Built:
        if self._last is not None:
            change = describe_change(self._last, signature, evaluation.eval_inputs(state), batch)
            message = f"fsg: the evaluation's abstract signature changed ({change})"
            if self._strict:
                raise RecompileError(f"{message}; strict=True forbids a recompile. Keep shapes fixed.")
            warnings.warn(
                f"{message}; tracing and compiling it again. Keep shapes fixed.", RecompileWarning, stacklevel=3
            )
        built = self._build(state, batch)
        built = built._replace(fn=backend_lib.compile_graph(built.graph, self._backend))
        self._cache[signature] = built
        return built

    def _build(self, state: TrainState, batch: Any) -> _Built:
        """Stage 1, and stage 2 on a mesh."""
        self._check_specs(state, batch)
        if self._mesh is None:
            fuse = fused_loss_lib.wanted(self._fused_loss, state)
            traced = evaluation.trace_eval(self._fn, state, batch, precision=self._precision, fused_loss=fuse)
            gm = traced.step.graph_module
            return _Built(traced, gm, None, None, {"traced": gm})
        inputs = evaluation.eval_inputs(state)
        plan = placement.make_plan(inputs, batch, self._batch_sharding, self._mesh)
        state_leaves, state_def = tree.flatten(inputs)
        batch_leaves, batch_def = tree.flatten(batch)
        with _torch_private.fake_mode():  # global-shaped stand-ins
            fakes = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in [*state_leaves, *batch_leaves]]
        n = len(state_leaves)
        # as Builder._mesh_build: DTensor shards the CPU attention only as its math
        attention = sdpa_kernel([SDPBackend.MATH]) if self._mesh.device_type == "cpu" else contextlib.nullcontext()
        with attention, plain_math():
            traced = evaluation.trace_eval(
                self._fn, tree.unflatten(state_def, fakes[:n]), tree.unflatten(batch_def, fakes[n:]),
                precision=self._precision, mark_uses=True, source_lines=True,
                decompositions=op_support.mesh_decompositions(), fused_loss=fused_loss_lib.wanted(self._fused_loss, state),
            )  # fmt: skip
        local_inputs = [t.to_local() for t in state_leaves] + placement.local_batch(
            batch_leaves, plan.batch_placements, self._mesh
        )
        local = spmd.expand(
            traced.step, plan, [tuple(t.shape) for t in state_leaves], [tuple(t.shape) for t in batch_leaves],
            local_inputs,
        )  # fmt: skip
        stages = {"traced": traced.step.graph_module, "sharded": local}
        return _Built(traced, local, None, plan, stages)

    def _check_specs(self, state: TrainState, batch: Any) -> None:
        """The batch spec fits the batch; with ``param_sharding``, the state's params are placed
        as those rules say (a state from a train step compiled with other rules is refused)."""
        mesh = self._declared_mesh
        if mesh is None:
            return
        if self._mesh is None:
            placement.batch_placements(
                tree.flatten(batch)[0], tree.leaf_paths(batch, "batch"), self._batch_sharding, mesh
            )
            placement.check_param_specs(state.params, mesh, self._param_sharding)
            return
        if self._param_sharding is None:
            return
        rules = self._param_sharding
        leaves = tree.flatten(state.params)[0]
        for name, path, leaf in zip(param_names(state.params), tree.leaf_paths(state.params, "state.params"), leaves):
            if not isinstance(leaf, DTensor):
                return  # placement.make_plan says how to place the state
            want = tuple(mesh.placements(rules.spec_for(name, tuple(leaf.shape), mesh)))
            have = tuple(leaf.placements)
            if have != want:
                raise MeshError(
                    f"{path} is placed {have}, but param_sharding gives it {want}: evaluate a state with "
                    f"the param_sharding its train step was compiled with (or pass none: the state's "
                    f"placements are used as they are)"
                )


def compile_eval(
    fn: evaluation.EvalFn,
    mesh: Mesh | None = None,
    *,
    param_sharding: Rules | None = None,
    batch_sharding: P | None = None,
    precision: Policy | None = None,
    backend: str = "inductor",
    strict: bool = False,
    fused_loss: bool | None = None,
) -> EvalStep:
    """Compiles an evaluation step: ``fn`` forward only, its modules in eval mode.

    Every module ``fsg.apply`` runs inside ``fn`` runs as after ``module.eval()``: dropout off,
    BatchNorm normalizing by its running statistics (pass them in the state:
    ``step.init(params, buffers=fsg.buffers(model))``). Traced at the first call, compiled, and
    replayed for later calls of the same signature, like ``compile_step``'s step, and cached
    apart from it: evaluating inside a training loop does not recompile the train step.

    Args:
      fn: ``fn(params, batch)`` (``fn(params, batch, buffers)`` when the state has buffers)
        returning a tensor or a dict ``{name: tensor}``. Pure, as a ``loss_fn`` is.
      mesh: an ``fsg.Mesh``, as the train step's; ``None`` runs on one device.
      param_sharding: the train step's ``param_sharding``; when given, the state's params must
        be placed as it says. The state's own placements are used either way.
      batch_sharding: the spec of every batch leaf; default ``P("dp")`` on a mesh with ``dp``.
      precision: an ``fsg.Policy``; ``fn`` computes in its compute dtype.
      backend: ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"``.
      strict: raise ``RecompileError`` instead of recompiling when the signature changes.
      fused_loss: as ``compile_step``'s (without gradients: the loss of each chunk of logits).

    Returns:
      An ``EvalStep``: ``metrics = ev(state, batch)`` reads ``state.params``,
      ``state.buffers`` and ``state.rng`` and never writes them; on a mesh the result has
      global semantics (equal to the unsharded evaluation's, on every rank).

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
      >>> def accuracy(params, batch):
      ...     logits = fsg.apply(model, params, batch["x"])
      ...     return {"accuracy": (logits.argmax(-1) == batch["y"]).float().mean()}
      >>> ev = fsg.compile_eval(accuracy, backend="eager")
      >>> step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b["x"]).square().mean(),
      ...                         optimizer=fsg.optim.sgd(0.1), backend="eager")
      >>> state = step.init(fsg.params(model))
      >>> sorted(ev(state, {"x": torch.randn(8, 4), "y": torch.zeros(8, dtype=torch.long)}))
      ['accuracy']
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"compile_eval: mesh must be an fsg.Mesh or None, got {type(mesh).__name__}")
    checks.flag("compile_eval(fused_loss=...)", fused_loss, optional=True)
    return EvalStep(
        fn, mesh, param_sharding=param_sharding, batch_sharding=batch_sharding, precision=precision,
        backend=backend, strict=strict, fused_loss=fused_loss,
    )  # fmt: skip
