"""Non-finite steps are skipped inside the graph (docs/resilience.md)."""

import pytest
import torch

import fsg
from fsg._src import tree
from fsg._src.kernels._common import cpu_interpreter
from fsg._src.runtime.nonfinite import SkipNonFinite
from tests.helpers import mlp, mse_loss_fn, regression_batch


def _leaves(state):
    return [t.clone() for t in tree.flatten((state.params, state.opt_state, state.buffers))[0]]


def _nan_batch(seed=0):
    batch = regression_batch(seed=seed)
    batch["y"][3, 1] = float("nan")
    return batch


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_step_leaves_params_and_optimizer_state_unchanged_and_is_counted(fused):
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1),
                            backend="aot_eager", fused_optimizer=fused, skip_nonfinite=True)  # fmt: skip
    state = step.init(fsg.params(model))
    state, m = step(state, regression_batch(seed=0))
    before = _leaves(state)
    state, m = step(state, _nan_batch())
    assert torch.isnan(m["loss"]) and int(m["skipped"]) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _leaves(state)))
    assert int(state.step) == 2 and int(state.skips.skipped) == 1 and int(state.skips.consecutive) == 1
    state, m = step(state, regression_batch(seed=1))  # a finite step applies again
    assert int(m["skipped"]) == 1 and int(state.skips.consecutive) == 0
    assert not torch.equal(before[0], state.params["0.weight"])
    assert int(state.opt_state[0].count) == 2  # Adam counted the two applied updates only


def test_the_fused_update_reads_the_skip_flag_and_matches_the_traced_math():
    """With the fused AdamW kernel (Triton's interpreter on CPU), a run with a NaN step in the
    middle equals the traced update's run, and the graph has one fused node, no traced math."""
    runs = []
    for fused in (False, True):
        model = mlp(seed=3)
        step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), backend="aot_eager",
                                fused_optimizer=fused, skip_nonfinite=True)  # fmt: skip
        state = step.init(fsg.params(model))
        if fused:
            text = step.lower(state, regression_batch()).as_text()
            assert text.count("fsg.fused_adamw_") == 1 and "aten.where" not in text.split("fused_adamw_")[1]
        with cpu_interpreter():
            for i in range(4):
                state, _ = step(state, _nan_batch(i) if i == 2 else regression_batch(seed=i))
        runs.append(state)
    assert int(runs[1].skips.skipped) == 1
    for a, b in zip(tree.flatten(runs[0])[0], tree.flatten(runs[1])[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_infinite_gradient_with_a_finite_loss_is_skipped():
    def loss_fn(p, b):  # sqrt at 0: the value is 0, its gradient +inf
        return ((b["x"] @ p["w"]) ** 2).mean() + torch.sqrt(p["w"][0, 0] - p["w"][0, 0].detach())

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager", skip_nonfinite=True)
    state = step.init({"w": torch.randn(3, 2)})
    w = state.params["w"].clone()
    state, m = step(state, {"x": torch.randn(4, 3)})
    assert torch.isfinite(m["loss"]) and not torch.isfinite(m["grad_norm"])
    assert int(m["skipped"]) == 1 and torch.equal(state.params["w"], w)


def test_buffers_are_kept_at_a_skipped_step_and_unread_ones_cost_no_copy():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("unused", torch.ones(2))

    def loss_fn(params, batch, buffers):
        out = fsg.apply(model, params, batch["x"], buffers=buffers)
        return ((out - batch["y"]) ** 2).mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager", skip_nonfinite=True)
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    unused = tree.leaf_paths(state, "state").index("state.buffers['unused']")
    assert f"copy_.default(arg{unused}_1," not in step.lower(state, regression_batch()).as_text()
    state, _ = step(state, regression_batch(seed=0))
    mean = state.buffers["1.running_mean"].clone()
    batch = regression_batch(seed=1)
    batch["x"][0, 0] = float("nan")  # BatchNorm's statistics of this batch are NaN
    state, m = step(state, batch)
    assert int(m["skipped"]) == 1 and torch.equal(state.buffers["1.running_mean"], mean)
    state, m = step(state, regression_batch(seed=2))
    assert torch.isfinite(state.buffers["1.running_mean"]).all() and not torch.equal(state.buffers["1.running_mean"], mean)


def test_off_lets_the_nan_in():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="aot_eager",
                            skip_nonfinite=False)  # fmt: skip
    state, m = step(step.init(fsg.params(model)), _nan_batch())
    assert "skipped" not in m and torch.isnan(state.params["0.weight"]).any()


def test_too_many_skips_in_a_row_raise_at_the_next_check_naming_the_steps():
    model = mlp()
    policy = SkipNonFinite(max_consecutive=3, check_every=2)
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="aot_eager",
                            skip_nonfinite=policy)  # fmt: skip
    state = step.init(fsg.params(model))
    state, _ = step(state, regression_batch())  # step 0 applies
    for _ in range(2):  # steps 1 and 2 skipped: call 2 is checked (1 in a row), call 3 is not
        state, _ = step(state, _nan_batch())
    with pytest.raises(fsg.FsgError, match=r"steps 1 to 3 .* 3 in a row, at least max_consecutive=3") as info:
        step(state, _nan_batch())  # call 4 finds 3 skips in a row
    assert type(info.value).__name__ == "NonFiniteError"


def test_a_recovering_run_is_not_stopped():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="aot_eager",
                            skip_nonfinite=SkipNonFinite(max_consecutive=2, check_every=1))  # fmt: skip
    state = step.init(fsg.params(model))
    for i in range(6):
        state, m = step(state, _nan_batch() if i % 2 else regression_batch(seed=i))
    assert int(m["skipped"]) == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(skip_nonfinite="yes"), r"skip_nonfinite=...\) must be True, False, None or an fsg.SkipNonFinite"),
        (dict(skip_nonfinite=SkipNonFinite(check_every=0)), r"SkipNonFinite\(check_every=...\) must be an int >= 1"),
        (dict(skip_nonfinite=False, precision=fsg.Policy(compute=torch.float16)), "contradicts the Policy's float16"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(fsg.ArgumentError, match=match):
        fsg.compile_step(mse_loss_fn(mlp()), optimizer=fsg.optim.sgd(0.1), **kwargs)


def test_a_state_without_counters_is_refused():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="aot_eager", skip_nonfinite=True)
    state = step.init(fsg.params(model))._replace(skips=())
    with pytest.raises(fsg.StructureMismatchError, match="state.skips"):
        step(state, regression_batch())
