"""Functions the ``verify=True`` tests run on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fsg
import fsg.sharding
import fsg.testing
from fsg._src import _torch_private
from tests.dist.workers import gpt_batches, gpt_loss, preset_rules, tiny_gpt
from tests.helpers import mlp, regression_batch


def verified_run_equals_plain_run(axes: dict, preset: str) -> list[float]:
    """A GPT under AdamW with ``verify=True`` passes the check and then trains exactly as
    the same step without it; returns the losses."""
    model = tiny_gpt()
    kwargs = dict(
        optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), param_sharding=preset_rules(preset),
        batch_sharding=fsg.P("dp") if "dp" in axes else fsg.P(), backend="eager",
    )  # fmt: skip
    checked = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), verify=True, **kwargs)
    plain = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), **kwargs)
    a, b = checked.init(fsg.params(model)), plain.init(fsg.params(model))
    losses = []
    for batch in gpt_batches(2):
        a, metrics_a = checked(a, batch)
        b, metrics_b = plain(b, batch)
        assert torch.equal(metrics_a["loss"], metrics_b["loss"])
        losses.append(metrics_a["loss"].item())
    for name in b.params:
        assert torch.equal(a.params[name].full_tensor(), b.params[name].full_tensor()), name
    return losses


@torch.library.custom_op("fsg_test::center_rows", mutates_args=())
def center_rows(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0, keepdim=True)


@center_rows.register_fake
def _(x):
    return torch.empty_like(x)


# centering is a symmetric projection: its backward is itself
center_rows.register_autograd(lambda ctx, grad: torch.ops.fsg_test.center_rows(grad))

_REGISTERED = []


def _register_wrong_rule() -> None:
    """A deliberately wrong sharding rule: it claims rows are independent, so each rank
    centers its own rows by its own mean instead of the global one."""
    if _REGISTERED:
        return
    _REGISTERED.append(True)

    @_torch_private.register_sharding(torch.ops.fsg_test.center_rows.default)
    def _strategy(x):
        return [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()])]


def verify_catches_a_wrong_rule(axes: dict) -> tuple[str, float]:
    """Returns the VerificationError's message and how far the unchecked step drifts."""
    _register_wrong_rule()
    model = mlp(d_in=8, d_hidden=16, d_out=4)

    def loss_fn(params, batch):
        h = torch.ops.fsg_test.center_rows(fsg.apply(model, params, batch["x"]))
        return F.mse_loss(h, batch["y"])

    batch = regression_batch(n=8, d_in=8, d_out=4)
    for verify in (True, False):
        step = fsg.compile_step(
            loss_fn, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), backend="eager", verify=verify
        )
        try:
            state, _ = step(step.init(fsg.params(model)), batch)
        except fsg.VerificationError as exc:
            message = str(exc)
    single = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager")
    ref, _ = single(single.init(fsg.params(model)), batch)
    drift = max((state.params[k].full_tensor() - ref.params[k]).abs().max().item() for k in ref.params)
    return message, drift
