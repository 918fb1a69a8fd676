"""compile_step(..., accum_steps=k): the mean over k microbatches, in one graph."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _token_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))


def _token_loss(model):
    def loss_fn(params, batch):
        logits = fsg.apply(model, params, batch["x"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), ignore_index=-100)
        accuracy = ((logits.argmax(-1) == batch["y"]) & (batch["y"] != -100)).sum() / (batch["y"] != -100).sum()
        return loss, {"accuracy": accuracy}

    return loss_fn


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([2, 3, 4]), st.integers(0, 2**31 - 1), st.floats(0.0, 0.9))
def test_weighted_accumulation_equals_the_full_batch_for_a_loss_over_a_varying_count(accum_steps, seed, ignored):
    """A token-mean cross-entropy with ``ignore_index`` (a random share of the tokens, so each
    microbatch has its own count): with ``microbatch_weight`` = the count, the accumulated step's
    loss, aux metric and parameters equal the full batch's (with equal weights they do not:
    microbatches would count, not tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 20, (12, 6), generator=g)
    y = torch.randint(0, 20, (12, 6), generator=g).masked_fill(torch.rand(12, 6, generator=g) < ignored, -100)
    y[:, 0] = torch.randint(0, 20, (12,), generator=g)  # every microbatch keeps a token
    batch = {"x": x, "y": y}
    results = []
    for k, weight in ((1, None), (accum_steps, lambda mb: (mb["y"] != -100).sum())):
        model = _token_model()
        step = fsg.compile_step(_token_loss(model), optimizer=fsg.optim.adamw(1e-2), accum_steps=k,
                                microbatch_weight=weight, backend="eager")  # fmt: skip
        state = step.init(fsg.params(model))
        for _ in range(2):
            state, metrics = step(state, batch)
        results.append((state, metrics))
    (full, full_m), (acc, acc_m) = results
    for name in ("loss", "accuracy"):
        torch.testing.assert_close(acc_m[name], full_m[name], rtol=1e-5, atol=1e-6, msg=name)
    for k in full.params:
        torch.testing.assert_close(acc.params[k], full.params[k], rtol=1e-4, atol=1e-6, msg=k)


def test_equal_weights_are_the_default_and_differ_from_the_full_batch_for_such_a_loss():
    """What ``microbatch_weight`` is for: the default mean of microbatch means is not the full
    batch's token mean when the microbatches hold different numbers of tokens."""
    y = torch.randint(0, 20, (8, 6), generator=torch.Generator().manual_seed(1))
    y[0::2, 1:] = -100  # microbatch 0 of 2 keeps 1 token a row, microbatch 1 all 6
    batch = {"x": torch.randint(0, 20, (8, 6), generator=torch.Generator().manual_seed(2)), "y": y}
    losses = {}
    for k in (1, 2):
        model = _token_model()
        step = fsg.compile_step(_token_loss(model), optimizer=fsg.optim.sgd(0.1), accum_steps=k, backend="eager")
        losses[k] = float(step(step.init(fsg.params(model)), batch)[1]["loss"])
    assert abs(losses[1] - losses[2]) > 1e-3


def test_a_weight_that_is_not_a_0d_tensor_is_refused():
    model = _token_model()
    batch = {"x": torch.randint(0, 20, (4, 6)), "y": torch.randint(0, 20, (4, 6))}
    for weight, said in ((lambda mb: 3, r"a Python int \(3\)"), (lambda mb: mb["y"] != -100, r"shape \(2, 6\)")):
        step = fsg.compile_step(_token_loss(model), optimizer=fsg.optim.sgd(0.1), accum_steps=2,
                                microbatch_weight=weight, backend="eager")  # fmt: skip
        with pytest.raises(fsg.ArgumentError, match=rf"microbatch_weight=\.\.\.\) must return a 0-d tensor.*{said}"):
            step(step.init(fsg.params(model)), batch)
    with pytest.raises(fsg.ArgumentError, match="microbatch_weight"):
        fsg.compile_step(_token_loss(model), optimizer=fsg.optim.sgd(0.1), accum_steps=2, microbatch_weight=3)
