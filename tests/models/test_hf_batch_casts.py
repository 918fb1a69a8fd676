"""The batched parameter casts (passes/batch_casts.py) on models we did not write: for every
family of the Hugging Face corpus (tests/models/hf_models.py), a bf16 step whose parameter
casts all come from one ``fsg::cast_flat`` equals the plain step bit for bit (run op by op:
the op's CPU path is a ``copy_`` cast, the same rounding as ``.to()``)."""

import pytest
import torch

import fsg
from fsg._src.passes.options import Fusions

pytest.importorskip("transformers")

from tests.models import hf_models  # noqa: E402


def two_steps(kind: str, forced: bool):
    model = hf_models.make(kind)
    step = fsg.compile_step(
        hf_models.loss_fn(model), optimizer=fsg.optim.adamw(1e-3), precision=fsg.Policy(compute=torch.bfloat16),
        backend="eager", donate=False, fusions=Fusions(on_cpu={"batch_casts"} if forced else frozenset()),
    )  # fmt: skip
    state, losses = step.init(fsg.params(model)), []
    counts = step.lower(state, hf_models.batches(1, kind=kind)[0]).op_counts()
    for batch in hf_models.batches(2, kind=kind):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state.params, counts


@pytest.mark.parametrize("kind", hf_models.KINDS)
def test_one_cast_launch_keeps_the_step(kind):
    losses, params, counts = two_steps(kind, forced=True)
    plain_losses, plain_params, plain_counts = two_steps(kind, forced=False)
    assert counts.get("fsg.cast_flat", 0) == 1 and "fsg.cast_flat" not in plain_counts, counts
    assert counts.get("aten._to_copy", 0) < plain_counts.get("aten._to_copy", 0)
    assert losses == plain_losses
    assert all(torch.equal(params[k], plain_params[k]) for k in params)
