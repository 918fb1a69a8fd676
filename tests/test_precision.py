"""fsg.Policy: float32 parameters and optimizer, bfloat16 compute."""

import pytest
import torch

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch, rel_err

BF16 = fsg.Policy(param=torch.float32, compute=torch.bfloat16)


def test_bf16_compute_runs_matmuls_in_bf16_and_keeps_fp32_state():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), precision=BF16, backend="aot_eager")
    state = step.init(fsg.params(model))
    graph = step.lower(state, regression_batch()).graph_module.graph
    matmuls = [n for n in graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    assert matmuls and all(n.meta["val"].dtype == torch.bfloat16 for n in matmuls)
    losses = []
    for _ in range(10):
        state, metrics = step(state, regression_batch())  # fit one batch
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    leaves, _ = fsg._src.tree.flatten(state.params)
    assert all(leaf.dtype == torch.float32 for leaf in leaves)
    assert state.opt_state[0].mu["0.weight"].dtype == torch.float32


def test_bf16_compute_matches_an_eager_reference_doing_the_same_casts():
    batches = [regression_batch(seed=i) for i in range(5)]
    model = mlp(seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for b in batches:
        opt.zero_grad()
        params = {k: v.to(torch.bfloat16) for k, v in model.named_parameters()}
        out = torch.func.functional_call(model, params, (b["x"].bfloat16(),))
        ((out - b["y"].bfloat16()) ** 2).mean().float().backward()
        opt.step()
    step = fsg.compile_step(
        mse_loss_fn(mlp(seed=2)), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.0), precision=BF16, backend="aot_eager"
    )
    state = step.init(fsg.params(mlp(seed=2)))
    for b in batches:
        state, _ = step(state, b)
    for k, p in model.named_parameters():
        assert rel_err(state.params[k], p.detach()) < 1e-3, k


def test_param_policy_casts_the_state_at_init():
    model = mlp()
    policy = fsg.Policy(param=torch.bfloat16, compute=torch.bfloat16)
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), precision=policy, backend="aot_eager")
    state = step.init(fsg.params(model))
    assert state.params["0.weight"].dtype == torch.bfloat16
    state, metrics = step(state, regression_batch())
    assert state.params["0.weight"].dtype == torch.bfloat16 and torch.isfinite(metrics["loss"])


@pytest.mark.parametrize(
    "policy, match",
    [
        (lambda: "bf16", "precision must be an fsg.Policy; got str 'bf16'"),
        (
            lambda: fsg.Policy(compute=torch.int32),
            r"fsg.Policy\(compute=...\) must be a floating-point torch.dtype; got dtype torch.int32",
        ),
        (lambda: fsg.Policy(reduce="bf16"), r"fsg.Policy\(reduce=...\) must be a floating-point torch.dtype; got str 'bf16'"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(policy, match):
    model = mlp()
    with pytest.raises(fsg.FsgError, match=match):  # at fsg.Policy(...) or at compile_step
        fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), precision=policy())


def test_reduce_dtype_changes_nothing_on_one_device():
    model = mlp()
    batch = regression_batch(n=16)
    results = []
    for reduce in (None, torch.bfloat16):
        step = fsg.compile_step(
            mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), precision=fsg.Policy(reduce=reduce), backend="aot_eager"
        )
        state, _ = step(step.init(fsg.params(model)), batch)
        results.append(state.params)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
