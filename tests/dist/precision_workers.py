"""Functions the multi-rank precision tests run on every rank (module-level: they are pickled)."""

from __future__ import annotations

import torch

import fsg
from tests.helpers import mlp, mse_loss_fn


def float8_on_a_mesh_is_refused() -> str:
    """compile_step with Policy(matmul=fsg.Float8()) on a 2-rank mesh: the error's message."""
    mesh = fsg.Mesh({"dp": 2}, device_type="cpu")
    policy = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8())
    try:
        fsg.compile_step(mse_loss_fn(mlp()), mesh, optimizer=fsg.optim.adamw(1e-3), precision=policy)
    except fsg.FsgError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"
