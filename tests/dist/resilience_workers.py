"""Functions the non-finite-skip tests run on every rank (module-level: they are pickled)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsg
import fsg.testing
from fsg._src import tree
from tests.dist.workers import preset_rules
from tests.helpers import mlp, regression_batch


def _loss_fn(model):
    def loss_fn(params, batch):
        out = fsg.apply(model, params, batch["x"])
        w = params["0.weight"]
        # batch["z"] == 0 somewhere: sqrt's gradient there is +inf while its value stays 0
        poke = torch.sqrt(batch["z"][:, :1] + (w[:1, :1] - w[:1, :1].detach())).mean()
        return ((out - batch["y"]) ** 2).mean() + poke

    return loss_fn


def _batch(seed: int, poison: str | None) -> dict:
    """A global batch of 16 rows; on the calling rank only, ``poison`` puts a NaN in its own
    rows of the data ("data") or makes its rows' gradient infinite with a finite loss ("grad")."""
    batch = {**regression_batch(n=16, seed=seed), "z": torch.ones(16, 1)}
    if poison is not None:
        rows = slice(8 * dist.get_rank(), 8 * dist.get_rank() + 8)  # this rank's shard of P("dp")
        if poison == "data":
            batch["x"][rows.start, 0] = float("nan")
        else:
            batch["z"][rows] = 0.0
    return batch


def _full(state) -> list[torch.Tensor]:
    return [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tree.flatten(state)[0]]


def nan_on_one_rank_is_skipped_everywhere(axes: dict, preset: str, poison: str) -> dict:
    """Three steps; at the second, rank 1 alone sees a poisoned shard. Returns what the test
    compares across ranks."""
    model = mlp()
    step = fsg.compile_step(
        _loss_fn(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2), param_sharding=preset_rules(preset),
        batch_sharding=fsg.P("dp"), backend="aot_eager", skip_nonfinite=True,
    )  # fmt: skip
    state = step.init(fsg.params(model))
    state, _ = step(state, _batch(0, None))
    before = _full(state)
    state, metrics = step(state, _batch(1, "data" if dist.get_rank() == 1 and poison == "data" else None)
                          if poison == "data" else _batch(1, "grad" if dist.get_rank() == 1 else None))  # fmt: skip
    after = _full(state)
    kept = all(torch.equal(a, b) for a, b in zip(before[1:], after[1:]) if a.is_floating_point())
    skipped = int(metrics["skipped"].full_tensor() if hasattr(metrics["skipped"], "full_tensor") else metrics["skipped"])
    state, last = step(state, _batch(2, None))
    return {"skipped": skipped, "kept": kept, "after": after, "final": _full(state), "last_loss": float(last["loss"])}
