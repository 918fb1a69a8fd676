"""Stage 2: expand the global step graph into a per-rank graph with collectives.

The global graph of stage 1 is re-run by an FX interpreter on ``DTensor`` inputs (placements
from the specs) under ``make_fx``, so DTensor's own sharding propagation emits
``_c10d_functional`` collectives into a local graph over the rank's shards. Four rules
(``../shared/DESIGN.md`` §2) steer it:

1. outputs are constrained to their declared placements (metrics replicated);
2. each gradient (``fsg::grad`` marker) is constrained to its parameter's placement right
   after backward (all-reduce for replicated params, reduce-scatter for sharded ones);
3. data axes shard storage, not compute: at each parameter read (``fsg::param_use``) the
   parameter is gathered over the data axes (FSDP), while the optimizer reads the shard;
4. an op DTensor has no registered rule for (or whose rule refuses its placements) runs on
   gathered inputs, with a ``ShardingFallbackWarning``; where no rank can run it alone (it
   draws random numbers, writes its inputs, or is not an ATen op) it raises
   ``ShardingRuleError`` naming the op and source line.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, NamedTuple

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from fsg._src import _torch_private, tree
from fsg._src.errors import ShardingFallbackWarning, ShardingRuleError
from fsg._src.kernels import dtensor_rules  # noqa: F401 - DTensor rules for fsg ops that stay fused on a mesh
from fsg._src.mesh import Mesh
from fsg._src.sharding import convolution, flex_attention, op_support, raw_collectives
from fsg._src.trace import libraries, markers, purity
from fsg._src.trace.tracing import TracedStep


class ShardPlan(NamedTuple):
    """Where every input of the step graph lives on the mesh."""

    mesh: Mesh
    state_placements: tuple[tuple[Placement, ...], ...]  # one per flat state leaf
    batch_placements: tuple[tuple[Placement, ...], ...]  # one per flat batch leaf
    param_leaves: tuple[int, ...]  # index in the flat state of each parameter leaf
    data_axes: tuple[str, ...]  # mesh axes that shard the batch

    def param_placements(self, i: int) -> tuple[Placement, ...]:
        return self.state_placements[self.param_leaves[i]]

    def compute_placements(self, i: int) -> tuple[Placement, ...]:
        """A parameter's placements with its data axes gathered (rule 3)."""
        data = {self.mesh.axis_names.index(a) for a in self.data_axes}
        return tuple(Replicate() if d in data else p for d, p in enumerate(self.param_placements(i)))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def local_shard(t: torch.Tensor, placements: tuple[Placement, ...], mesh: Mesh) -> torch.Tensor:
    """This rank's piece of the global tensor ``t`` (mesh axes split in order, as DTensor does)."""
    coords = mesh.device_mesh.get_coordinate()
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            t = t.tensor_split(mesh.shape[axis], dim=placement.dim)[coords[axis]]
    return t


def _redistribute(x: Any, mesh: Mesh, placements: tuple[Placement, ...]) -> Any:
    if not isinstance(x, DTensor) or tuple(x.placements) == tuple(placements):
        return x
    return x.redistribute(mesh.device_mesh, placements)


_NO_RULE = NotImplementedError(f"DTensor has no sharding rule for it in torch {torch.__version__}")


def _has_rule(target: Any) -> bool:
    """Whether DTensor may run ``target``: an op with a registered rule (or no op at all)."""
    return not isinstance(target, _torch_private.OpOverload) or _torch_private.dtensor_has_rule(target)


def _gather_dim(x: DTensor, mesh: Mesh, dim: int) -> DTensor:
    """``x`` with tensor dim ``dim`` whole on every rank (other placements kept)."""
    dim = dim % max(x.dim(), 1)
    placements = tuple(Replicate() if isinstance(p, Shard) and p.dim == dim else p for p in x.placements)
    return _redistribute(x, mesh, placements)


def _is_plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def _guarded(target: Any) -> Any:
    """While DTensor runs an ATen op: no raw ``torch.distributed`` op reaches the graph
    (``raw_collectives``). Higher-order operators run unguarded (their own dispatch)."""
    return raw_collectives.Guard() if isinstance(target, _torch_private.OpOverload) else contextlib.nullcontext()


class _Expander(fx.Interpreter):
    """Runs the global graph on DTensors, applying the sharding rules."""

    def __init__(
        self, gm: fx.GraphModule, plan: ShardPlan, mark_grads: bool = False, reduce_dtype: torch.dtype | None = None
    ):
        super().__init__(gm)
        self.plan = plan
        self.mark_grads = mark_grads
        self.reduce_dtype = reduce_dtype
        self._node: fx.Node | None = None
        self._data_dims = frozenset(plan.mesh.axis_names.index(a) for a in plan.data_axes)

    def run_node(self, n: fx.Node) -> Any:
        self._node = n
        result = super().run_node(n)
        if isinstance(result, DTensor) and len(n.users) > 1 and any(isinstance(p, Partial) for p in result.placements):
            # A partial sum read by several ops would be reduced once per reader; reduce it
            # once here (Megatron's all-reduce after the row-parallel matmul). Single-reader
            # partials stay partial, so a gradient still reaches its marker unreduced and is
            # reduce-scattered there (FSDP).
            placements = [Replicate() if isinstance(p, Partial) else p for p in result.placements]
            result = result.redistribute(self.plan.mesh.device_mesh, placements)
        return result

    def _replicated(self, value: Any) -> Any:
        if not _is_plain(value):
            return value
        replicate = [Replicate()] * self.plan.mesh.device_mesh.ndim
        return DTensor.from_local(value, self.plan.mesh.device_mesh, replicate, run_check=False)

    def get_attr(self, target, args, kwargs):
        # Constants (a module's own buffers, literals) are replicated on every rank.
        return self._replicated(super().get_attr(target, args, kwargs))

    def call_function(self, target, args, kwargs):
        mesh = self.plan.mesh
        args, kwargs = op_support.plain_containers((args, kwargs))
        if target is markers.PARAM_USE:  # rule 3: gather over data axes where the loss reads it
            return _redistribute(args[0], mesh, self.plan.compute_placements(args[1]))
        if target is markers.GRAD:  # rule 2: the gradient takes its parameter's placement
            grad = self._reduce(args[0], self.plan.param_placements(args[1]))
            if self.mark_grads and isinstance(grad, DTensor):  # for the fusion pass
                local = markers.grad(grad.to_local(), args[1])
                grad = DTensor.from_local(
                    local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
                )
            return grad
        if target is torch.ops.aten.lift_fresh_copy.default and isinstance(args[0], DTensor):
            return args[0].clone()  # a literal tensor, already replicated by get_attr
        if target is torch.ops.aten.copy_.default and isinstance(args[0], DTensor):
            # Donation writes the new value into the old leaf: same placement (rule 1).
            args = (args[0], _redistribute(args[1], mesh, tuple(args[0].placements)), *args[2:])
        full = op_support.full_reduction(target, args, kwargs)
        if full is not None and isinstance(args[0], DTensor):
            target, args, kwargs = full
        args = op_support.non_negative_stack_dim(target, args)
        args = op_support.index_put_args(target, args, mesh.device_mesh)
        if target in op_support.SCANS and isinstance(args[0], DTensor):
            args = (_gather_dim(args[0], mesh, args[1]), *args[1:])
        if (local := flex_attention.run_local(target, args, kwargs, mesh.device_mesh)) is not None:
            return local  # a FlexAttention sharded on batch or heads, each rank its own
        like = self._node.meta.get("val") if self._node is not None else None
        if (local := convolution.run_local(target, args, kwargs, mesh.device_mesh, self._data_dims, like)) is not None:
            return local  # each rank its own images, without torch's halo exchange (raw sends)
        leaves, _ = tree.flatten((args, kwargs))
        if any(isinstance(a, DTensor) for a in leaves) and not _has_rule(target):
            # rule 4: never DTensor's run-time derivation from the op's decomposition, which
            # sizes means and counts from the local shard (see op_support): the global op on
            # gathered inputs, or a ShardingRuleError where no rank can run it alone
            return self._fallback(target, args, kwargs, _NO_RULE, local=True)
        if any(isinstance(a, DTensor) for a in leaves) and any(_is_plain(a) for a in leaves):
            # Tensors made inside the step (masks, aranges) are the same on every rank.
            args, kwargs = tree.tree_map(self._replicated, (args, kwargs))
        try:
            with _guarded(target):
                result = super().call_function(target, args, kwargs)
        except NotImplementedError as exc:  # rule 4: DTensor has no rule for this op at all
            return self._fallback(target, args, kwargs, exc, local=True)
        except (RuntimeError, IndexError, KeyError) as exc:
            return self._fallback(target, args, kwargs, exc)
        if not op_support.covers_mesh(result, mesh.device_mesh.ndim):  # a rule for 1-D meshes only
            why = RuntimeError(f"DTensor's rule gave its result fewer placements than the mesh has dims ({mesh!r})")
            return self._fallback(target, args, kwargs, why, local=True)
        return result

    def _fallback(self, target, args, kwargs, exc: Exception, local: bool = False) -> Any:
        """DTensor has rules for the op but could not apply them to these placements (some
        torch releases refuse, e.g., to flatten a sharded dim): gather the inputs and run it
        replicated, by DTensor, or by each rank on its whole copy where the rule fails on whole
        inputs too (torch 2.11's convolution) or is malformed (``local``). Correct, at the price
        of the gathers, and said in a warning; ``ShardingRuleError`` where that fails too."""
        device_mesh, result = self.plan.mesh.device_mesh, None
        replicated = op_support.gather_all((args, kwargs), device_mesh)
        if replicated is not None and not local:
            with contextlib.suppress(Exception), _guarded(target):  # else the rule fails on whole inputs too
                result = super().call_function(target, *replicated)
        if result is None or not op_support.covers_mesh(result, device_mesh.ndim):
            try:
                like = self._node.meta.get("val") if self._node is not None else None
                result = op_support.run_replicated(target, *(replicated or (args, kwargs)), device_mesh, like)
            except Exception:  # noqa: BLE001 - reported as the ShardingRuleError below
                result = None
        if result is None:  # not even on whole inputs, or an op no rank can run alone (random)
            raise self._no_rule(target, exc, (args, kwargs)) from exc
        where = purity.user_frame_of_node(self._node) if self._node is not None else "(unknown)"
        fix = "write it with other ops" if exc is _NO_RULE else "change the specs feeding it"
        warnings.warn(
            f"fsg: op {target} at {where} could not run on its inputs' placements "
            f"({str(exc).splitlines()[0][:160]}); its inputs were gathered and it ran replicated "
            f"on every rank. To avoid the extra collectives and compute, {fix}.",
            ShardingFallbackWarning,
            stacklevel=3,
        )
        return result

    def _reduce(self, grad: Any, placements: tuple[Placement, ...]) -> Any:
        """Rule 2's redistribution, the sum in ``reduce_dtype`` (``Policy.reduce``) if set."""
        partial = isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements)
        if not partial or self.reduce_dtype is None or grad.dtype == self.reduce_dtype:
            return _redistribute(grad, self.plan.mesh, placements)
        return _redistribute(grad.to(self.reduce_dtype), self.plan.mesh, placements).to(grad.dtype)

    def _no_rule(self, target, exc: Exception | None, args_kwargs: Any) -> ShardingRuleError:
        where = purity.user_frame_of_node(self._node) if self._node is not None else "(source line unknown)"
        return op_support.no_rule_error(target, where, exc, args_kwargs)


def expand(
    traced: TracedStep,
    plan: ShardPlan,
    state_shapes: list[tuple[int, ...]],
    batch_shapes: list[tuple[int, ...]],
    local_inputs: list[torch.Tensor],
    mark_grads: bool = False,
    reduce_dtype: torch.dtype | None = None,
) -> fx.GraphModule:
    """Stage 2: the per-rank graph of ``traced`` under ``plan``.

    Its inputs are the rank's local pieces of the state then the batch leaves; its outputs
    those of the global graph, as local tensors (metrics replicated). ``mark_grads`` keeps an
    ``fsg::grad`` marker on each rank's gradient (after its reduction) for the fusion pass;
    ``reduce_dtype`` (``Policy.reduce``) is the dtype gradients are reduced in.
    """
    mesh = plan.mesh
    placements = [*plan.state_placements, *plan.batch_placements]
    shapes = [*state_shapes, *batch_shapes]
    n_metrics = len(traced.metric_names)
    replicate = tuple(Replicate() for _ in mesh.shape)

    def local_step(*locals_):
        dtensors = [DTensor.from_local(t, mesh.device_mesh, pl, run_check=False, shape=torch.Size(s),
                                       stride=_contiguous_stride(s)) for t, pl, s in zip(locals_, placements, shapes)]  # fmt: skip
        outputs = _Expander(traced.graph_module, plan, mark_grads, reduce_dtype).run(*dtensors)
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        n_new_state = len(outputs) - n_metrics
        local_outputs = []
        for i, out in enumerate(outputs):
            target = plan.state_placements[i] if i < n_new_state else replicate
            out = _redistribute(out, mesh, target)  # rule 1
            local_outputs.append(out.to_local() if isinstance(out, DTensor) else out)
        return tuple(local_outputs)

    with libraries.tracing():
        gm = _torch_private.trace_fake(local_step, *local_inputs)
    # Constants (get_attr) before the inputs: a pass that moves ops to right after the last input
    # (defer's hoist) must not move them above a constant they read (an eval BatchNorm's stats).
    first = next(iter(gm.graph.nodes))
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        first.prepend(node)
    # A failed first attempt of an op (before the replicated fallback) can leave a dead,
    # ill-shaped node in the trace; in-place writes (donation's copy_) are kept as impure.
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def run_global(gm: fx.GraphModule, mesh: Any, inputs: list[DTensor]) -> Any:
    """Runs a global graph that carries no ``fsg::`` markers (a pipeline stage's action) on
    ``DTensor`` inputs under rules 1 and 4, every mesh axis a data axis; ``mesh`` has
    ``axis_names``, ``shape`` and ``device_mesh`` (``pipeline/data_axes.DataMesh``)."""
    return _Expander(gm, ShardPlan(mesh, (), (), (), tuple(mesh.axis_names))).run(*inputs)
