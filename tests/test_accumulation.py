"""compile_step(..., accum_steps=k): the mean over k microbatches, in one graph."""

import pytest
import torch

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch, rel_err


def run(accum_steps, steps=3):
    model = mlp()
    step = fsg.compile_step(
        mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), accum_steps=accum_steps, backend="aot_eager"
    )
    state = step.init(fsg.params(model))
    losses = []
    for i in range(steps):
        state, metrics = step(state, regression_batch(n=16, seed=i))
        losses.append(metrics["loss"])
    return state, losses, step


def test_accumulated_step_equals_the_full_batch_step():
    full, full_losses, _ = run(1)
    accum, accum_losses, step = run(4)
    assert step.num_compiles == 1
    for a, b in zip(accum_losses, full_losses):
        assert float(a) == pytest.approx(float(b), rel=1e-6)
    for k in full.params:
        assert rel_err(accum.params[k], full.params[k]) < 1e-5, k


def test_the_graph_holds_one_forward_and_backward_per_microbatch():
    _, _, step = run(4, steps=1)
    model = mlp()
    state = step.init(fsg.params(model))
    ops = step.lower(state, regression_batch(n=16)).op_counts()
    assert ops["aten.tanh"] == 4 and ops["aten.tanh_backward"] == 4


def test_a_batch_that_does_not_split_names_the_leaf():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), accum_steps=3, backend="aot_eager")
    with pytest.raises(fsg.BatchError, match=r"batch\['x'\] has 16 rows, which accum_steps=3 cannot split"):
        step(step.init(fsg.params(model)), regression_batch(n=16))


def test_a_0d_batch_leaf_is_a_batch_leaf_without_accumulation_and_an_error_with_it():
    model = mlp()

    def loss_fn(params, batch):
        return mse_loss_fn(model)(params, batch) * batch["w"]

    batch = {**regression_batch(n=16), "w": torch.tensor(2.0)}
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    _, metrics = step(step.init(fsg.params(model)), batch)
    assert torch.allclose(metrics["loss"], 2 * mse_loss_fn(model)(fsg.params(model), regression_batch(n=16)))
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), accum_steps=2, backend="aot_eager")
    with pytest.raises(fsg.BatchError, match=r"batch\['w'\] has a 0-d tensor, which accum_steps=2 cannot split"):
        step(step.init(fsg.params(model)), batch)


def test_microbatch_leaves_are_contiguous_as_a_users_batch_is():
    """A loss may ``.view`` its inputs, as Hugging Face's losses do (``labels.view(-1)``): each
    microbatch leaf arrives contiguous, as the batch a user passes would, whatever rows it
    holds; the step still equals the full-batch step."""
    model = mlp()
    seen = []

    def loss_fn(params, batch):
        seen.append({k: v.is_contiguous() for k, v in batch.items()})
        out = fsg.apply(model, params, batch["x"])
        return ((out.view(-1) - batch["y"].view(-1)) ** 2).mean()

    results = []
    for accum_steps in (1, 4):
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), accum_steps=accum_steps, backend="eager")
        state, metrics = step(step.init(fsg.params(model)), regression_batch(n=16))
        results.append((state, metrics["loss"]))
    assert seen and all(all(v.values()) for v in seen)
    (full, full_loss), (accum, accum_loss) = results
    assert float(accum_loss) == pytest.approx(float(full_loss), rel=1e-6)
    for k in full.params:
        assert rel_err(accum.params[k], full.params[k]) < 1e-5, k
