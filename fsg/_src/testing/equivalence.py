"""``assert_sharded_matches_unsharded``: the central property, for users' own tests."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from fsg._src import tree
from fsg._src.mesh import Mesh, P
from fsg._src.optim._base import GradientTransformation
from fsg._src.rules import Rules
from fsg._src.runtime.compile_step import compile_step


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_sharded_matches_unsharded(
    loss_fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    mesh: Mesh,
    *,
    optimizer: GradientTransformation,
    param_sharding: Rules | None = None,
    batch_sharding: P | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    backend: str = "eager",
    buffers: Any = None,
    **step_options: Any,
) -> None:
    """Runs the step sharded on ``mesh`` and unsharded, batch by batch, and asserts that the
    losses, parameters, optimizer state and ``buffers`` (e.g. ``fsg.buffers(model)``: BatchNorm's
    running statistics) agree within ``rtol``/``atol`` after every step.

    Call it on every rank (e.g. under ``torchrun`` or ``fsg.testing.MultiRank``).
    ``step_options`` (``precision=``, ``accum_steps=``) go to both ``compile_step`` calls.
    Sharding is decided in stages 1-3, so both steps run their graphs uncompiled by default
    (``backend="eager"``, the fastest to build); pass ``backend="inductor"`` to check the
    compiled steps too.

    Raises:
      AssertionError naming the step, the leaf path and the largest difference.

    Example:
      >>> fsg.testing.assert_sharded_matches_unsharded(            # doctest: +SKIP
      ...     loss_fn, fsg.params(model), batches, fsg.Mesh({"dp": 2}),
      ...     optimizer=fsg.optim.adamw(1e-3), param_sharding=fsg.sharding.fsdp("dp"))
    """
    sharded = compile_step(
        loss_fn,
        mesh,
        optimizer=optimizer,
        param_sharding=param_sharding,
        batch_sharding=batch_sharding,
        backend=backend,
        **step_options,
    )
    single = compile_step(loss_fn, optimizer=optimizer, backend=backend, **step_options)
    state, ref = sharded.init(params, buffers=buffers), single.init(params, buffers=buffers)
    for i, batch in enumerate(batches):
        state, metrics = sharded(state, batch)
        ref, ref_metrics = single(ref, batch)
        torch.testing.assert_close(
            metrics["loss"], ref_metrics["loss"], rtol=rtol, atol=atol, msg=lambda m, i=i: f"step {i + 1}: loss: {m}"
        )
        got, _ = tree.flatten(state)
        want, _ = tree.flatten(ref)
        for path, a, b in zip(tree.leaf_paths(ref, "state"), got, want):
            torch.testing.assert_close(
                _full(a), b, rtol=rtol, atol=atol, msg=lambda m, i=i, path=path: f"step {i + 1}: {path}: {m}"
            )
