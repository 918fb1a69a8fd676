"""Functions the multi-rank randomness tests run on every rank (issue 21: keyed random ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fsg
import fsg.sharding
import fsg.testing
from tests.helpers import regression_batch


def dropout_mlp(p: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 32), nn.Tanh(), nn.Dropout(p),
                         nn.Linear(32, 4))  # fmt: skip


def _loss(model: nn.Module, extra: bool):
    def loss_fn(params, batch):
        out = fsg.apply(model, params, batch["x"])
        if extra:  # the other keyed ops, on activations sharded like the batch
            out = out * torch.rand_like(out) + 0.1 * torch.randn_like(out) + F.dropout(out, 0.2)
        return ((out - batch["y"]) ** 2).mean()

    return loss_fn


RULES = {"dp": fsg.sharding.data_parallel, "fsdp": lambda: fsg.sharding.fsdp("dp"), "tp": None}


def check_dropout(axes: dict, preset: str, p: float, accum_steps: int = 1, extra: bool = False) -> float:
    """The dropout MLP sharded under ``preset`` equals the unsharded step over 3 steps (the
    batch sharded over "dp" when the mesh has it); returns the last loss, which differs from
    the step without dropout (so the masks did something)."""
    model = dropout_mlp(p)
    batches = [regression_batch(n=16, seed=i) for i in range(3)]
    rules = RULES[preset]() if RULES[preset] else fsg.sharding.rules([(r"0\.weight", fsg.P("tp"))])
    batch_sharding = fsg.P("dp") if "dp" in axes else fsg.P()
    fsg.testing.assert_sharded_matches_unsharded(
        _loss(model, extra), fsg.params(model), batches, fsg.testing.mesh(axes),
        optimizer=fsg.optim.adamw(1e-2), param_sharding=rules, batch_sharding=batch_sharding,
        accum_steps=accum_steps,
    )  # fmt: skip
    step = fsg.compile_step(_loss(model, extra), fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.0),
                            param_sharding=rules, batch_sharding=batch_sharding, backend="eager")  # fmt: skip
    _, metrics = step(step.init(fsg.params(model)), batches[0])
    return float(metrics["loss"])


def plain_loss(axes: dict) -> float:
    """The loss of ``check_dropout``'s first batch with dropout off (p=0)."""
    model = dropout_mlp(0.0)
    step = fsg.compile_step(_loss(model, False), optimizer=fsg.optim.sgd(0.0), backend="eager")
    _, metrics = step(step.init(fsg.params(model)), regression_batch(n=16, seed=0))
    return float(metrics["loss"])
