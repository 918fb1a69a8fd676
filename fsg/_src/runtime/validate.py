"""What ``compile_step``, ``Step.init`` and the first call of a step check before tracing: each
bad input raises an ``FsgError`` that names the argument or leaf, states the rule and says
what to do, rather than a raw error from deep inside a trace. Everything here runs once per
step, at ``init`` or on a compile-cache miss, never on the replay path.

The libraries check their own arguments (``optim/_checks.py``, the checkpoint modules, ``mesh``,
``rules``, ``precision``) with the helpers of ``fsg/_src/checks.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch

from fsg._src import checks, tree
from fsg._src.backend.inductor import BACKENDS
from fsg._src.errors import ArgumentError, FsgError, StructureMismatchError
from fsg._src.mesh import Mesh, P
from fsg._src.optim._base import check_transformation
from fsg._src.optim._complex import real_views
from fsg._src.precision import check_policy
from fsg._src.rules import Rules
from fsg._src.train_state import TrainState


def check_compile_args(loss_fn: Any, mesh: Any, optimizer: Any, options: dict[str, Any]) -> None:
    """The arguments of ``compile_step`` (``options``: its keyword-only ones)."""
    if isinstance(loss_fn, torch.nn.Module):
        raise checks.fail(
            "compile_step(loss_fn)", "must be a function loss_fn(params, batch) returning the loss, not a module",
            loss_fn, "Write def loss_fn(params, batch): return F.cross_entropy(fsg.apply(model, params, batch['x']), ...)",
        )  # fmt: skip
    checks.function("compile_step(loss_fn)", loss_fn, fix="Pass a function loss_fn(params, batch) returning the loss")
    if mesh is not None:
        checks.instance("compile_step(mesh=...)", mesh, Mesh, what="an fsg.Mesh or None", fix="E.g. fsg.Mesh({'dp': 2})")
    check_transformation("compile_step(optimizer=...)", optimizer)
    rules = options["param_sharding"]
    if rules is not None and not isinstance(rules, Rules):
        fix = "Build rules with fsg.sharding.rules([(regex, fsg.P(...)), ...]) or a preset such as fsg.sharding.fsdp()"
        if isinstance(rules, P):
            fix = f"For one spec for every parameter write fsg.sharding.rules([], default={rules!r})"
        raise checks.fail("compile_step(param_sharding=...)", "must be fsg.sharding rules or None", rules, fix)
    spec = options["batch_sharding"]
    if spec is not None and not isinstance(spec, P):
        checks.instance("compile_step(batch_sharding=...)", spec, P, what="an fsg.P or None",
                        fix="Name the axes in a spec, e.g. fsg.P('dp')")  # fmt: skip
    if options["precision"] is not None:
        check_policy(options["precision"])
    checks.integer("compile_step(accum_steps=...)", options["accum_steps"], low=1,
                   fix="It is the number of microbatches per step; 1 means no accumulation")  # fmt: skip
    if options["microbatch_weight"] is not None:
        checks.function("compile_step(microbatch_weight=...)", options["microbatch_weight"],
                        fix="Pass a function of a microbatch, e.g. lambda b: (b['labels'] != -100).sum()")  # fmt: skip
    if options["backend"] not in BACKENDS:
        raise ArgumentError(f"compile_step(backend=...): unknown backend {options['backend']!r}; choose one of {BACKENDS}")
    for name in ("donate", "strict", "verify"):
        checks.flag(f"compile_step({name}=...)", options[name])
    for name in ("fused_optimizer", "cuda_graph", "fused_loss"):
        checks.flag(f"compile_step({name}=...)", options[name], optional=True)
    if options["bucket_mb"] is not None:
        checks.real("compile_step(bucket_mb=...)", options["bucket_mb"], low=0.0, fix="Pass None or 0 for no buckets")
    if options["check_replicas"] is not None:
        checks.integer("compile_step(check_replicas=...)", options["check_replicas"], low=0,
                       fix="It is how many steps pass between two replica checks; 0 or None turns them off")  # fmt: skip


def check_init(params: Any, seed: Any) -> None:
    """The arguments of ``Step.init``."""
    if isinstance(params, torch.nn.Module):
        raise checks.fail("step.init(params)", "must be a pytree of tensors, not a module", params,
                          "Pass fsg.params(model)")  # fmt: skip
    if isinstance(params, Iterator):  # model.parameters() / named_parameters(): a generator of tensors
        raise checks.fail(
            "step.init(params)",
            "must be a pytree of tensors keyed by name, not an iterator",
            params,
            "Pass fsg.params(model) (a dict {name: tensor}, tied weights stored once) instead of model.parameters()",
        )
    tree.check_tensor_leaves(params, "params")
    if not any(p.is_floating_point() or p.is_complex() for p in tree.flatten(params)[0]):
        raise checks.fail("step.init(params)", "has no floating-point tensor, so the step would train nothing", params,
                          "Pass fsg.params(model) of a model with parameters")  # fmt: skip
    checks.integer("step.init(seed=...)", seed, low=0, fix="The seed keys the step's random ops (state.rng)")
    if seed >= 2**63:
        raise checks.fail("step.init(seed=...)", "must be below 2**63 (it is stored as int64)", seed)


def check_inputs(loss_fn: Any, optimizer: Any, state: Any, batch: Any) -> None:
    """What the first call with a new signature checks before tracing: the state is this step's
    (a ``TrainState`` whose optimizer state the step's optimizer would build for its params)
    and ``loss_fn`` takes the arguments the step passes."""
    if not isinstance(state, TrainState):
        raise checks.fail(
            "step(state, batch): state", "must be the fsg.TrainState that step.init(params) returns", state,
            "Build it with step.init(fsg.params(model)) (or restore a checkpoint into one), and pass step(state, batch)",
        )  # fmt: skip
    if state.step.dim() != 0 or state.step.is_floating_point():
        raise ArgumentError(f"state.step must be a 0-d integer tensor; got {state.step.dtype}{list(state.step.shape)}")
    if state.rng.dtype != torch.int64 or tuple(state.rng.shape) != (2,):
        raise ArgumentError(
            f"state.rng must be an int64 tensor [seed, counter] of shape (2,); got {state.rng.dtype}"
            f"{list(state.rng.shape)}. Build the state with step.init(params, seed=...)"
        )
    _check_opt_state(optimizer, state)
    _check_arity(loss_fn, 3 if state.buffers else 2)


def _abstract_init(optimizer: Any, params: Any) -> Any:
    """``optimizer.init`` on meta stand-ins of ``params`` (nothing allocated); ``None`` when the
    optimizer's ``init`` cannot run on meta tensors (then nothing is checked)."""
    metas = real_views(tree.tree_map(lambda p: torch.empty(p.shape, dtype=p.dtype, device="meta"), params))
    try:
        return optimizer.init(metas)
    except FsgError:
        raise
    except Exception:  # noqa: BLE001 - a custom init that needs real tensors: skip the check
        return None


def _check_opt_state(optimizer: Any, state: TrainState) -> None:
    want = _abstract_init(optimizer, state.params)
    if want is None:
        return
    fix = (
        "Build the state with this step's init (step.init(params)): a state made by another step, for "
        "another optimizer or other params, cannot be carried over (restore a checkpoint with like=step.init(params))"
    )
    want_leaves, want_def = tree.flatten(want)
    have_leaves, have_def = tree.flatten(state.opt_state)
    if want_def != have_def:
        want_paths, have_paths = tree.leaf_paths(want, "state.opt_state"), tree.leaf_paths(state.opt_state, "state.opt_state")
        missing, extra = sorted(set(want_paths) - set(have_paths)), sorted(set(have_paths) - set(want_paths))
        detail = f"missing {missing[:4]}, unexpected {extra[:4]}" if missing or extra else f"{have_def} vs {want_def}"
        raise StructureMismatchError(
            f"state.opt_state is not what this step's optimizer.init(state.params) builds ({detail}). {fix}."
        )
    for path, w, h in zip(tree.leaf_paths(want, "state.opt_state"), want_leaves, have_leaves):
        if isinstance(w, torch.Tensor) and tuple(w.shape) != tuple(h.shape):
            raise StructureMismatchError(
                f"{path} has shape {tuple(h.shape)}, but this step's optimizer.init(state.params) gives "
                f"{tuple(w.shape)}: the params and the optimizer state do not belong together. {fix}."
            )


def _check_arity(loss_fn: Any, n: int) -> None:
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have none: nothing to check
        return
    try:
        signature.bind(*range(n))
    except TypeError as exc:
        call = "loss_fn(params, batch, buffers) (the state has buffers)" if n == 3 else "loss_fn(params, batch)"
        raise ArgumentError(
            f"the step calls {call}, but loss_fn{signature} cannot take that ({exc}). "
            f"Give loss_fn {'three' if n == 3 else 'two'} positional parameters"
        ) from exc
