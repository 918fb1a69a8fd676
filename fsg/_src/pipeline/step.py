"""``PipelineStep``: a train step on a mesh with a ``pp`` axis (docs/parallelism.md).

Each rank traces the forward and loss of one microbatch, splits it into stages
(``split.py``), compiles its own stages' forward, input-gradient and weight-gradient graphs
(``stage_fns.py``) and runs its list of the schedule's actions from Python (``runner.py``),
with ``torch.distributed`` point-to-point messages between ranks; on ``pp x dp`` each action's
graph is expanded over the ``dp`` sub-mesh (``data_axes.py``). Then the gradients of a
parameter several ranks hold (tied embeddings) are summed over them, the loss is broadcast from
the last stage, the global gradient norm is one all-reduce of sums of squares (also the norm
``fsg.optim.global_norm`` gives the update: clipping), and each rank applies the optimizer to
the parameters it holds, or keeps them on a non-finite step (``skip_nonfinite``). The DESIGN's goal, one static graph per rank
with the sends and receives inside it, is the follow-up.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsg._src import frozen, tree, watch
from fsg._src.errors import ArgumentError, RecompileError, RecompileWarning, UnsupportedError
from fsg._src.mesh import Mesh
from fsg._src.optim import _base as optim_base
from fsg._src.optim._base import GradientTransformation, apply_updates
from fsg._src.optim._transforms import learning_rate
from fsg._src.pipeline import checkpoints, data_axes, runner
from fsg._src.pipeline import plan as plan_lib
from fsg._src.pipeline.actions import Action
from fsg._src.pipeline.options import Pipeline
from fsg._src.pipeline.schedules import make_schedule
from fsg._src.pipeline.simulate import Cost, Timeline, simulate
from fsg._src.precision import Policy, at_least_float32
from fsg._src.trace import resilience
from fsg._src.train_state import TrainState


class PipelineStep:
    """A compiled pipeline-parallel train step: ``state, metrics = step(state, batch)``.

    Made by ``fsg.compile_step(..., mesh=fsg.Mesh({"pp": N}), pipeline=fsg.Pipeline(...))``.
    Each rank's ``state.params`` holds the parameters its stages read (a tied one on every
    rank that reads it); ``full_params(state)`` gathers them all.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        mesh: Mesh,
        optimizer: GradientTransformation,
        pipeline: Pipeline,
        *,
        accum_steps: int,
        backend: str,
        strict: bool,
        skip_nonfinite: bool = False,
    ):
        self._loss_fn, self._optimizer, self._options = loss_fn, optimizer, pipeline
        self._backend, self._strict, self._skip = backend, strict, skip_nonfinite
        pp = mesh.axis_size("pp")
        self._schedule = make_schedule(pipeline.schedule, pp, accum_steps, virtual=pipeline.virtual_stages)
        others = tuple(a for a in mesh.axis_names if a != "pp")
        if mesh.size > 1:
            self._group = mesh.device_mesh.get_group("pp")
            self._ranks = dist.get_process_group_ranks(self._group)  # the pp ranks at this rank's data coordinate
            self._me = self._ranks.index(dist.get_rank())
        else:
            self._group, self._ranks, self._me = None, [0], 0
        self._data = data_axes.DataMesh(mesh, others) if others and mesh.size > pp else None
        self._plan: plan_lib.Plan | None = None
        self._flags = watch.Flags()  # the modules the trace ran: their flags are checked at each call
        self.mesh = mesh
        self.executed: list[Action] = []  # this rank's actions in the order the last call ran them
        self.events: list = []  # their wall-clock Events (time.time(): one clock per host)

    @property
    def pipeline_index(self) -> int:
        """This rank's index on the ``pp`` axis (the row of ``step.schedule()`` it runs)."""
        return self._me

    @property
    def num_compiles(self) -> int:
        return int(self._plan is not None)

    def init(
        self, params: dict[str, torch.Tensor], *, seed: int = 0, batch: Any = None, buffers: Any = None
    ) -> TrainState:
        """This rank's ``TrainState``: the parameters its stages read, their optimizer state.

        Args:
          params: ``{name: tensor}`` (``fsg.params(model)``), every parameter, on every rank.
          seed: seeds ``state.rng``.
          batch: an example batch (its shapes and dtypes): the split is made on the traced
            step, which needs them.

        Example: see ``fsg.compile_step``'s ``pipeline`` argument.
        """
        if batch is None:
            raise ArgumentError(
                "a pipeline step's init needs an example batch (step.init(params, batch=batch)): the stages are cut "
                "from the traced forward, and which parameters a rank holds depends on where"
            )
        if buffers:
            raise UnsupportedError("a pipeline step does not carry buffers (BatchNorm statistics) yet; drop buffers=")
        if not isinstance(params, dict) or not all(isinstance(p, torch.Tensor) for p in params.values()):
            raise UnsupportedError("a pipeline step takes params as a flat dict {name: tensor} (fsg.params(model))")
        odd = [n for n, p in params.items() if not p.is_floating_point()]
        if odd:
            raise UnsupportedError(f"a pipeline step trains floating-point params only; params[{odd[0]!r}] is not")
        params = Policy().resolve(params).cast_param({n: p.detach().clone() for n, p in params.items()})
        plan_lib.check_per_parameter(self._optimizer, params)
        self._plan = self._build(params, batch)
        mine = {n: p for n, p in params.items() if self._me in self._plan.holders[n]}
        device = next(iter(params.values())).device
        return TrainState(
            step=torch.zeros((), dtype=torch.int64, device=device),
            params=mine,
            opt_state=self._optimizer.init(mine),
            rng=torch.tensor([seed, 0], dtype=torch.int64, device=device),
            buffers={},
            skips=resilience.initial_skips(device),
            loss_scale=(),
        )

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Runs one step; every rank returns its new state and the same metrics."""
        plan = self._plan_for(state, batch)
        result = runner.run(plan, self._me, self._ranks, state.params, batch, state.rng)
        self.executed = [e.action for e in result.events]
        self.events = result.events
        grads = {n: result.grads.get(n, torch.zeros_like(p)) for n, p in state.params.items()}
        for name in (n for n in plan.names if len(plan.holders[n]) > 1):  # tied: summed over its holders
            g = grads[name] if name in grads else torch.zeros(self._shape(plan, name), dtype=self._dtype(plan, name))
            self._all_reduce(g)
        split = optim_base.LeafSplit(functools.partial(self._norm, plan, list(state.params)))
        metrics = self._metrics(plan, result, split.norm(tree.flatten(grads)[0]))
        with torch.no_grad(), optim_base.split_leaves(split):
            updates, opt_state = self._optimizer.update(grads, state.opt_state, state.params)
            params = apply_updates(state.params, updates)
        if plan.kept & state.params.keys():  # frozen or unreached: as they were, optimizer state too (frozen.keep)
            keys, params_def = tree.flatten({n: n for n in state.params})[0], tree.flatten(state.params)[1]
            kept = {i for i, n in enumerate(keys) if n in plan.kept}  # leaf indices, in flatten order
            old = (state.params, state.opt_state)
            params, opt_state = frozen.kept_leaves((params, opt_state), old, params_def, kept)
        skips = state.skips
        if self._skip:  # the loss and the norm are the same on every rank: one decision
            finite = resilience.is_finite(metrics["loss"], metrics["grad_norm"])
            params, opt_state = resilience.keep_if_skipped(finite, (params, opt_state), (state.params, state.opt_state))
            skips = resilience.next_skips(finite, state.skips)
            metrics["skipped"] = skips.skipped
        lr = learning_rate(opt_state)
        if lr is not None:
            metrics["lr"] = lr
        rng = torch.cat([state.rng[:1], state.rng[1:] + 1])
        new = TrainState(state.step + 1, params, opt_state, rng, state.buffers, skips, state.loss_scale)
        return new, dict(sorted(metrics.items()))

    def schedule(self) -> Timeline:
        """The schedule's per-rank timeline as predicted from each stage's cost (forward FLOPs;
        the input and weight gradients each costed as one forward), with ``.bubble`` and
        ``.draw(path)``. Before ``init`` every stage costs the same."""
        if self._plan is None:
            return simulate(self._schedule, Cost())
        costs = [s.cost for s in self._plan.stages]
        scale = max(costs) or 1.0
        return simulate(self._schedule, lambda a: costs[a.stage] / scale)

    def lower(self, state: TrainState, batch: Any):
        raise UnsupportedError(
            "step.lower() does not lower a pipeline step yet; step.schedule() gives its per-rank timeline and bubble"
        )

    def full_params(self, state: TrainState) -> dict[str, torch.Tensor]:
        """Every parameter on every rank, each sent from the first rank holding it (a collective)."""
        plan, out = self._require_plan(), {}
        for name in plan.names:
            owner = plan.holders[name][0]
            t = (
                state.params[name].clone()
                if self._me == owner
                else torch.empty(self._shape(plan, name), dtype=self._dtype(plan, name))
            )
            if self._group is not None:
                dist.broadcast(t, src=self._ranks[owner], group=self._group)
            out[name] = t
        return out

    def save(self, path: str, state: TrainState, *, metadata: Any = None) -> None:
        """Saves the whole state as one checkpoint, each leaf written by the first stage's rank
        holding it: the unsharded step's tree, so it restores onto any ``pp`` size or none
        (``pipeline/checkpoints.py``). Call it on every rank."""
        plan = self._require_plan()
        every = {n: torch.empty(self._shape(plan, n), dtype=self._dtype(plan, n), device="meta") for n in plan.names}
        writes = self._data is None or dist.get_rank(self._data.group) == 0
        checkpoints.save(
            path, state, optimizer=self._optimizer, every_param=every, holders=plan.holders, me=self._me,
            writes=writes, metadata=metadata,
        )  # fmt: skip

    def restore(self, path: str, like: TrainState) -> TrainState:
        """This rank's state from a checkpoint of the whole state (``save``'s on any ``pp``
        size, or an unsharded step's); ``like``: this rank's state (``step.init``)."""
        return checkpoints.restore(path, like)

    def _plan_for(self, state: TrainState, batch: Any) -> plan_lib.Plan:
        plan = self._require_plan()
        same_batch, flags = plan_lib.batch_signature(batch) == plan.batch_specs, self._flags.now()
        if same_batch and flags == plan.flags:
            return plan
        what = "batch signature" if not same_batch else f"modules' flags ({self._flags.describe(plan.flags, flags)})"
        message = f"fsg: the pipeline step's {what} changed; tracing and compiling it again"
        if self._strict:
            raise RecompileError(message.replace("tracing and compiling it again", "strict=True forbids a recompile"))
        warnings.warn(message, RecompileWarning, stacklevel=3)
        full = {
            n: state.params.get(n, torch.empty(self._shape(plan, n), dtype=self._dtype(plan, n))) for n in plan.names
        }
        new = self._build(full, batch)
        if new.holders != plan.holders:
            raise UnsupportedError(
                "the new batch shape moves parameters between pipeline ranks; keep batch shapes fixed for a pp step"
            )
        self._plan = new
        return new

    def _build(self, params: dict[str, torch.Tensor], batch: Any) -> plan_lib.Plan:
        return plan_lib.build(
            self._loss_fn,
            params,
            batch,
            self._schedule,
            self._options,
            self._me,
            self._backend,
            self._data,
            self._flags,
        )

    def _require_plan(self) -> plan_lib.Plan:
        if self._plan is None:
            raise ArgumentError("call step.init(params, batch=...) before running a pipeline step")
        return self._plan

    def _norm(self, plan: plan_lib.Plan, names: list[str], leaves: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of a tree like ``state.params`` from this rank's part of it: each
        leaf counted on the first rank that holds it, the squares summed over the pp ranks
        (``fsg.optim.global_norm`` within the pipeline's update)."""
        keys = tree.flatten({n: n for n in names})[0]  # the leaves' names, in flatten order (by key)
        if len(leaves) != len(keys):
            raise UnsupportedError(
                f"fsg.optim.global_norm of {len(leaves)} leaves inside a pipeline step's update, whose rank holds "
                f"{len(keys)} params: a pipeline reduces a global norm over the updates' tree of params only"
            )
        dtype = plan.norm_dtype
        squares = torch.zeros((), dtype=dtype, device=leaves[0].device if leaves else None)
        for key, leaf in zip(keys, leaves):
            if plan.holders[key][0] == self._me:
                squares = squares + leaf.to(dtype).square().sum()
        self._all_reduce(squares)
        return torch.sqrt(squares)

    def _metrics(self, plan: plan_lib.Plan, result: runner.Result, grad_norm: torch.Tensor) -> dict[str, torch.Tensor]:
        last = self._schedule.rank_of(self._schedule.num_stages - 1)
        outs = plan.stages[-1].outputs
        if self._me == last:  # the mean over microbatches, as the unsharded step's accumulation
            values = [sum(o[i] for o in result.outputs) / len(result.outputs) for i in range(len(outs))]
            values[0] = values[0].detach().to(at_least_float32(values[0].dtype))
        else:
            values = [
                torch.empty(o.shape, dtype=at_least_float32(o.dtype) if i == 0 else o.dtype) for i, o in enumerate(outs)
            ]
        if self._group is not None:
            for v in values:
                dist.broadcast(v, src=self._ranks[last], group=self._group)
        metrics = {"loss": values[0], "grad_norm": grad_norm}
        metrics.update(zip(plan.aux_names, values[1:]))
        return metrics

    def _all_reduce(self, t: torch.Tensor) -> None:
        if self._group is not None:
            dist.all_reduce(t, group=self._group)

    def _shape(self, plan: plan_lib.Plan, name: str) -> tuple[int, ...]:
        return tuple(plan.like[name].shape)

    def _dtype(self, plan: plan_lib.Plan, name: str) -> torch.dtype:
        return plan.like[name].dtype
