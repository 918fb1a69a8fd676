"""``verify_step``: a user's own model, checked sharded against unsharded before it trains.

``compile_step(..., verify=True)`` calls it at the first step on a mesh. It runs that step
twice more, once sharded and once on gathered, unsharded copies of the state and batch, in
float64 by default: there rounding differs by ~1e-16, so a tolerance of 1e-7 separates a
sharding rule that computes something else (the errors it exists for are 1e-3 and up) from
reassociation, even through Adam, which turns float32 noise on near-zero gradients into
full-size updates. Then it runs the real step and returns its result.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsg._src import tree
from fsg._src.errors import FsgError, VerificationError
from fsg._src.precision import Policy

log = logging.getLogger("fsg")

# (rtol, atol) by the dtype the check runs in
TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (5e-3, 1e-3),
}


def _cast(leaf: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not leaf.is_floating_point():
        return leaf
    if isinstance(leaf, DTensor):
        return DTensor.from_local(
            leaf.to_local().to(dtype), leaf.device_mesh, leaf.placements, run_check=False,
            shape=leaf.shape, stride=leaf.stride(),
        )  # fmt: skip
    return leaf.to(dtype)


def _full(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.full_tensor() if isinstance(leaf, DTensor) else leaf


def _first_difference(got: Any, want: Any, root: str, rtol: float, atol: float) -> str | None:
    got_leaves, _ = tree.flatten(got)
    want_leaves, _ = tree.flatten(want)
    for path, a, b in zip(tree.leaf_paths(want, root), got_leaves, want_leaves):
        a = _full(a)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: {a.dtype}{list(a.shape)} sharded vs {b.dtype}{list(b.shape)} unsharded"
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"{path}: integer values differ"
            continue
        diff = (a.double() - b.double()).abs()
        allowed = atol + rtol * b.double().abs()
        if bool((diff > allowed).any()) or bool(a.isnan().ne(b.isnan()).any()):
            worst = int((diff - allowed).flatten().argmax())
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
            return (
                f"{path}: max |difference| {diff.max().item():.3g} at index {index} "
                f"(sharded {a.flatten()[worst].item():.8g}, unsharded {b.flatten()[worst].item():.8g}; "
                f"tolerance {atol:g} + {rtol:g}·|unsharded|)"
            )
    return None


def verify_step(
    step: Any,
    state: Any,
    batch: Any,
    *,
    dtype: torch.dtype | None = torch.float64,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Checks that ``step`` on its mesh computes what it computes unsharded, then runs it.

    The step is run sharded and on gathered, unsharded copies of ``state`` and ``batch``
    (with the backend ``"eager"``, the traced math, no fused optimizer), both in ``dtype``
    (float64 by default; ``None``: the step's own precision policy); metrics and every leaf
    of the new state are compared. Call it on every rank, in place of the first
    ``step(state, batch)``: it returns what that call returns.

    Args:
      step: a ``Step`` from ``fsg.compile_step`` (on one device there is nothing to check).
      state, batch: the step's inputs (``state`` is donated as usual).
      dtype: the floating-point dtype of the check.
      rtol, atol: the tolerance; default by dtype (float64: 1e-7, 1e-9).

    Returns:
      ``(new_state, metrics)`` of the real step.

    Raises:
      VerificationError naming the first metric or state leaf that differs, by how much.

    Example:
      >>> state, metrics = fsg.testing.verify_step(step, state, batch)   # doctest: +SKIP
    """
    if step.mesh is None:
        log.info("fsg: verify: the step runs on one device; nothing to compare")
        return step(state, batch)
    check_dtype = dtype or step.precision.resolve(state.params).compute
    default_rtol, default_atol = TOLERANCES.get(check_dtype, TOLERANCES[torch.float32])
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    precision = Policy(dtype, dtype, None) if dtype is not None else step.precision
    sharded = step.variant(mesh=step.mesh, precision=precision)
    single = step.variant(mesh=None, precision=precision)
    sharded_state = tree.tree_map(lambda t: _cast(t, dtype), state)
    sharded_batch = tree.tree_map(lambda t: _cast(t, dtype), batch)
    single_state = tree.tree_map(lambda t: _cast(_full(t), dtype), state)
    single_batch = tree.tree_map(lambda t: _cast(_full(t), dtype), batch)
    try:
        got_state, got_metrics = sharded(sharded_state, sharded_batch)
        want_state, want_metrics = single(single_state, single_batch)
    except FsgError:
        raise
    except Exception as exc:
        raise VerificationError(
            f"verify: the step could not run in {dtype} for the check ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); check it in its own precision with "
            f"fsg.testing.verify_step(step, state, batch, dtype=None)"
        ) from exc
    found = _first_difference(got_metrics, want_metrics, "metrics", rtol, atol) or _first_difference(
        got_state, want_state, "state", rtol, atol
    )
    if found is not None:
        raise VerificationError(
            f"verify: the sharded step on {step.mesh!r} differs from the unsharded step ({check_dtype}): "
            f"{found}. A sharding rule computed an op differently on shards. Find the op by "
            f"replicating parameters (param_sharding) or the batch (batch_sharding=fsg.P()) until "
            f"the check passes, and report it; docs/sharding.md lists the ops verified on a mesh."
        )
    log.info("fsg: verify: the sharded step equals the unsharded step (%s, rtol %g, atol %g)", check_dtype, rtol, atol)
    return step(state, batch)
