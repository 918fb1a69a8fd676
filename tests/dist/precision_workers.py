"""Functions the multi-rank precision tests run on every rank (module-level: they are pickled)."""

from __future__ import annotations

import torch

import fsg
from tests.dist.workers import gpt_batches, gpt_loss, preset_rules, tiny_gpt
from tests.helpers import mlp, mse_loss_fn

ROWWISE = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))


def float8_on_a_mesh_is_refused() -> str:
    """compile_step with Policy(matmul=fsg.Float8()) (tensorwise) on a 2-rank mesh: the error's message."""
    mesh = fsg.Mesh({"dp": 2}, device_type="cpu")
    policy = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8())
    try:
        fsg.compile_step(mse_loss_fn(mlp()), mesh, optimizer=fsg.optim.adamw(1e-3), precision=policy)
    except fsg.FsgError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def rowwise_matches_unsharded(axes: dict, preset: str, policy: str) -> int:
    """The tiny GPT's step under ``preset`` equals the unsharded step with the same policy
    (``"rowwise"`` or ``"bf16"``, the reference for how close bf16 steps come); returns how
    many ``_scaled_mm`` and fused GELU-gradient casts the sharded step's graph holds."""
    precision = ROWWISE if policy == "rowwise" else fsg.Policy(compute=torch.bfloat16)
    model = tiny_gpt()
    # SGD, not Adam: Adam turns a gradient's last-bit difference near zero into a whole update
    options = dict(optimizer=fsg.optim.sgd(0.1), param_sharding=preset_rules(preset),
                   batch_sharding=fsg.P("dp"), precision=precision)  # fmt: skip
    fsg.testing.assert_sharded_matches_unsharded(
        gpt_loss(model), fsg.params(model), gpt_batches(), fsg.testing.mesh(axes), rtol=2e-2, atol=2e-3, **options
    )
    step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), backend="eager", **options)
    counts = step.lower(step.init(fsg.params(model)), gpt_batches(1)[0]).op_counts()
    return counts.get("aten._scaled_mm", 0), counts.get("fsg.gelu_backward_fp8", 0)


def rowwise_under_tensor_parallel_is_refused(axes: dict) -> str:
    model = tiny_gpt()
    step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2),
                            param_sharding=preset_rules("tp"), precision=ROWWISE, backend="eager")  # fmt: skip
    try:
        step(step.init(fsg.params(model)), gpt_batches(1)[0])
    except fsg.FsgError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"
