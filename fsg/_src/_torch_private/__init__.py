"""Every private or experimental torch API fsg uses, in one place (this package: the compilers'
entry points in ``inductor.py``, re-exported here).

torch's private names move between releases; fsg supports torch 2.11 (GPU) and 2.13 (CPU).
Each name here is pinned by ``tests/test_torch_private.py``, so an upgrade that moves one
fails one test, not the whole library.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from typing import Any, Callable

import torch
from torch import fx
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import register_sharding
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode

from fsg._src import decompositions as fsg_decompositions
from fsg._src._torch_private.inductor import (
    aot_eager_compile,
    buffer_storage,
    final_reduction_line,
    inductor_compile,
    wrapper_lines_rewritten,
)

__all__ = [  # fmt: skip
    "ALL_GATHER", "ALL_REDUCE", "DATA_DEPENDENT_ERRORS", "DYNAMIC_SHAPE_ERROR", "HOST_SYNC_OPS", "HigherOrderOperator",
    "OpOverload", "REDUCE_SCATTER", "TorchDispatchMode", "WAIT_TENSOR", "aliased_args", "all_decompositions", "arg_names",
    "buffer_storage", "core_decompositions", "default_store", "draws_random", "dtensor_has_rule", "dtensor_index_put_rule_is_positional",
    "fake_mode", "functionalize", "grad_hooks", "in_hop_compile", "inductor_compile", "is_collective", "is_pure_op", "lr_scheduler_parts",
    "mutated_args", "register_sharding", "reparametrize", "return_names", "trace_fake", "version", "wrapper_lines_rewritten",
    "FAKE_TENSOR_LOG", "final_reduction_line", "scaled_mm", "aot_eager_compile",
]

# What tracing raises when Python needs a tensor's value (``if x > 0:``; ``.item()`` where not captured).
DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (DataDependentOutputException, GuardOnDataDependentSymNode)

DYNAMIC_SHAPE_ERROR = DynamicOutputShapeException  # an op whose output shape tracing cannot know (``.func``)
# Ops that bring a tensor's value to the host (torch 2.13 records ``.item()`` so, not raising).
HOST_SYNC_OPS = frozenset({torch.ops.aten._local_scalar_dense.default})


FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")  # logs each failed meta call it then raises
scaled_mm = torch._scaled_mm  # the FP8 GEMM (a, b, scale_a, scale_b, *, out_dtype, use_fast_accum): public-ish, underscored


# The functional collectives stage 2 emits (DTensor lowers redistributions to them).
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default  # (input, group_size, group_name)
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


# ``register_sharding(op)(fn)`` (experimental in 2.11, 2.13): DTensor strategies for a custom op,
# ``fn`` returning ``[(output placements, input placements), ...]`` for one mesh dim.
register_sharding = register_sharding


def is_collective(target: Any) -> bool:  # a functional collective (or its wait)
    return isinstance(target, OpOverload) and target.namespace == "_c10d_functional"


def is_pure_op(target: Any) -> bool:  # an aten-style op whose schema mutates none of its inputs
    return isinstance(target, OpOverload) and not target._schema.is_mutable


def version(t: torch.Tensor) -> int:  # t's version counter, shared with its views: every in-place write moves it
    return t._version


def dtensor_has_rule(op: Any) -> bool:
    """Whether DTensor has a *registered* sharding rule for ``op`` (a strategy function, a single-dim strategy
    or a propagation rule), not one derived from the op's decomposition at run time (2.13+: local sizes)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(propagator, name, {}) for name in tables)


def dtensor_index_put_rule_is_positional() -> bool:
    """Whether DTensor's ``index_put`` rule is torch 2.11's ``prop_index_put``, which pairs ``values``'
    dims with ``self``'s from the right: for ``self[ids] += values`` (rows sharded) it shards ``self``'s
    indexed dim too and indexes each shard with the gathered ids (torch 2.13's rule is correct)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    rule = getattr(propagator, "op_strategy_funcs", {}).get(torch.ops.aten.index_put.default)
    return getattr(rule, "__name__", "") == "prop_index_put"


def default_store() -> Any:
    """The default process group's ``torch.distributed.Store`` (every rank reaches it without a collective)."""
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None


core_decompositions = core_aten_decompositions  # () -> torch's decompositions to core ATen (torch.export's set)
reparametrize = _reparametrize_module  # functional_call's (module, tensors, tie_weights, strict); fsg.apply's


def all_decompositions() -> dict[Any, Callable[..., Any]]:  # every registered Python decomposition
    return dict(decomposition_table)


def lr_scheduler_parts(s: Any) -> dict[str, Any]:  # OneCycleLR's phases and anneal ("cos"/"linear"); SequentialLR's
    anneal = getattr(s, "_anneal_func_type", None) or getattr(getattr(s, "anneal_func", None), "__name__", "")
    return {"phases": getattr(s, "_schedule_phases", None), "anneal": "cos" if "cos" in anneal else "linear",
            "schedulers": getattr(s, "_schedulers", None), "milestones": getattr(s, "_milestones", None)}  # fmt: skip


# Mutation and aliasing from an op's schema (``Tensor(a!)`` written, ``Tensor(a) -> Tensor(a)`` a view,
# ``Tensor(a -> *) -> Tensor(a)[]`` views); Python targets and higher-order ops have none: no facts.

def in_hop_compile() -> bool:  # inside the torch.compile that runs a higher-order operator eagerly (flex_attention's)
    from torch._higher_order_ops import utils
    return bool(getattr(getattr(utils, "_hop_compile_tls", None), "in_hop_compile", False))


def op_name(target: Any) -> str:
    """``"aten.mm"`` for an ``OpOverload`` (no overload); any other target's Python name."""
    if isinstance(target, OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def view_base(t: torch.Tensor) -> torch.Tensor:  # the tensor whose storage t views (t itself if not a view)
    return t if t._base is None else t._base


def grad_hooks(t: torch.Tensor) -> tuple[list[Callable[..., Any]], bool]:  # t.register_hook's; any post-accumulate?
    return list((t._backward_hooks or {}).values()), bool(getattr(t, "_post_accumulate_grad_hooks", None))


@functools.cache
def arg_names(target: Any) -> tuple[str, ...]:
    """An op's schema argument names, in order (``()`` for a non-``OpOverload`` target)."""
    return tuple(a.name for a in target._schema.arguments) if isinstance(target, OpOverload) else ()


@functools.cache
def return_names(target: Any) -> tuple[str, ...]:
    """An op's schema return names, in order (``""`` unnamed; ``()`` for a non-``OpOverload``)."""
    return tuple(r.name or "" for r in target._schema.returns) if isinstance(target, OpOverload) else ()


@functools.cache
def draws_random(target: Any) -> bool:
    """Whether an op may draw random numbers: tagged ``nondeterministic_seeded`` (``rand``, ``native_dropout``,
    attention with a ``dropout_p``) or taking a ``Generator`` argument (``random_``, ``binomial``)."""
    return isinstance(target, OpOverload) and (torch.Tag.nondeterministic_seeded in target.tags or
                                               any("Generator" in str(a.type) for a in target._schema.arguments))  # fmt: skip


@functools.cache
def mutated_args(target: Any) -> frozenset[int]:
    """The indices of the schema arguments an op writes in place (``Tensor(a!)``, and lists of
    them: ``Tensor(a!)[]``); empty for a functional op or a non-``OpOverload`` target."""
    arguments = target._schema.arguments if isinstance(target, OpOverload) else ()
    return frozenset(i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)


@functools.cache
def aliased_args(target: Any) -> frozenset[int]:
    """The indices of the schema arguments whose storage an op's result shares: a view's input
    (``Tensor(a) self -> Tensor(a)``, or ``Tensor(a -> *)`` for a list of views), an in-place or
    ``out=`` op's written argument that it returns. Empty when the result is a new tensor."""
    if not isinstance(target, OpOverload):
        return frozenset()
    schema = target._schema
    returned = set().union(*(r.alias_info.before_set for r in schema.returns if r.alias_info is not None))
    shared = (i for i, a in enumerate(schema.arguments) if a.alias_info is not None and
              (a.alias_info.before_set & returned or "*" in a.alias_info.after_set))  # fmt: skip
    return frozenset(shared)


def trace_fake(fn: Callable[..., Any], *args: torch.Tensor, source_lines: bool = False,
               decompositions: dict[Any, Callable[..., Any]] | None = None) -> torch.fx.GraphModule:  # fmt: skip
    """Traces ``fn(*args)`` to an aten FX graph on fake tensors. ``decompositions`` maps ops to
    Python functions run in their place; fsg's corrections and rewrites (``decompositions.py``)
    always apply. Real tensors ``fn`` closes over become graph constants. ``source_lines`` records
    each node's stack (``meta["stack_trace"]``: errors name the user's line; a fifth of the trace's
    time). Under ``_traceable``; ``torch.compile``d code traces as the Python it wraps."""
    table = {**(decompositions or {}), **fsg_decompositions.CORRECTIONS, **fsg_decompositions.DECLARED_WRITES}
    options = {"tracing_mode": "fake", "_allow_non_fake_inputs": True, "record_stack_traces": source_lines}
    # flex_attention's inner torch.compile with static shapes (automatic dynamic ones broke a second model's)
    with torch._dynamo.config.patch(error_on_nested_fx_trace=False, automatic_dynamic_shapes=False), _traceable():
        return make_fx(fn, decomposition_table=table, **options)(*args)


@contextlib.contextmanager
def _traceable():
    """While tracing: ``torch.distributions`` without default value checks (a trace has no
    values), and static samplers for those that loop on values (``VonMises``, ``Wishart``)."""
    slots = ((torch.distributions.Distribution, "_validate_args", False),
             (torch.distributions.von_mises, "_rejection_sample", fsg_decompositions.von_mises_rejection),
             (torch.distributions.Wishart, "rsample", _wishart_bartlett))  # fmt: skip
    saved = [getattr(owner, name) for owner, name, _ in slots]
    for owner, name, value in slots:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name, _), value in zip(slots, saved):
            setattr(owner, name, value)


def _wishart_bartlett(self: Any, sample_shape: Any = (), max_try_correction: Any = None) -> torch.Tensor:
    return self._bartlett_sampling(torch.Size(sample_shape))  # singular: negligible unless df ~ p - 1


def functionalize(gm: torch.fx.GraphModule, decompositions: dict[Any, Callable[..., Any]] | None = None) -> torch.fx.GraphModule:
    """``gm`` traced again through torch's functionalization: every in-place op becomes its
    out-of-place form and a write to an input one ``copy_`` into it at the end, so the only
    writes left are that epilogue. Views stay views; nodes keep their ``stack_trace``; nothing is
    computed (fake values). ``decompositions`` lowers the ops functionalization emits (``aten.copy``).
    Tensor constants are functionalized arguments too: an in-place op on a tensor computed from
    constants alone (``cross_entropy``'s with a weight, smoothing, an ignore index) is rewritten."""
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fetch = fx.Interpreter(gm).fetch_attr
    names = sorted({n.target for n in gm.graph.nodes if n.op == "get_attr" and isinstance(fetch(n.target), torch.Tensor)})

    def run(*args: Any) -> Any:
        constants, interpreter = dict(zip(names, args[len(inputs) :])), fx.Interpreter(gm)
        interpreter.fetch_attr = lambda target: constants[target] if target in constants else fetch(target)
        with fx.traceback.preserve_node_meta():
            return interpreter.run(*args[: len(inputs)])

    functional, values = torch.func.functionalize(run, remove="mutations"), [fetch(name) for name in names]
    options = {"decomposition_table": decompositions or {}, "tracing_mode": "fake", "_allow_non_fake_inputs": True}
    return make_fx(lambda *args: functional(*args, *values), **options)(*inputs)


def fake_mode() -> FakeTensorMode:  # a fake-tensor mode that accepts real constants: graphs run without data
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_result(mode: FakeTensorMode, target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    """``target``'s result on fakes of its node arguments' values (``meta["val"]``: shape,
    strides, dtype, device) under ``mode``: the value of a node a pass inserts."""

    def fake(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        v = a.meta["val"]
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)

    with mode:
        return target(*fx.node.map_aggregate(args, fake), **fx.node.map_aggregate(kwargs or {}, fake))


@contextlib.contextmanager
def mkldnn_disabled():
    """Within: oneDNN off, restored after. torch's own ``mkldnn.flags()`` also resets its
    deterministic and TF32 flags (and warns about TF32 on CPU builds); assigning
    ``torch.backends.mkldnn.enabled`` raises after ``torch.backends.disable_global_flags()``."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` a pass may rewrite: new nodes, their metadata and the constants shared,
    the code generator (``Graph._codegen``: how inputs and outputs are flattened) kept."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    return fx.GraphModule(gm, graph)
