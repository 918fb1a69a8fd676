"""float16 compute with a dynamic loss scale in the state (docs/resilience.md)."""

import pytest
import torch

import fsg
from fsg._src.precision import DynamicLossScale
from tests.helpers import mlp, mse_loss_fn, regression_batch


def _step(scale=None, **kwargs):
    model = mlp(seed=4)
    policy = fsg.Policy(compute=torch.float16, loss_scale=scale)
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), precision=policy,
                            backend="aot_eager", **kwargs)  # fmt: skip
    return step, step.init(fsg.params(model))


def _overflow(seed=0):
    batch = regression_batch(seed=seed)
    batch["y"][0, 0] = 6e4  # finite in float16, but its square is not
    return batch


def test_float16_policy_carries_a_scale_in_the_state_and_reports_it():
    step, state = _step()
    assert float(state.loss_scale.scale) == 2.0**15 and int(state.loss_scale.good_steps) == 0
    state, m = step(state, regression_batch())
    assert float(m["loss_scale"]) == 2.0**15 and int(m["skipped"]) == 0 and int(state.loss_scale.good_steps) == 1
    assert fsg.Policy(compute=torch.bfloat16).loss_scale is None
    assert fsg.Policy(compute=torch.float16, loss_scale=False).loss_scale is None


def test_an_overflow_halves_the_scale_and_skips_the_step():
    step, state = _step()
    state, _ = step(state, regression_batch())
    params = {k: v.clone() for k, v in state.params.items()}
    state, m = step(state, _overflow())
    assert int(m["skipped"]) == 1 and float(state.loss_scale.scale) == 2.0**14
    assert int(state.loss_scale.good_steps) == 0
    assert all(torch.equal(params[k], state.params[k]) for k in params)


def test_the_scale_doubles_after_n_clean_steps_and_never_drops_below_the_floor():
    step, state = _step(DynamicLossScale(initial=4.0, growth_interval=3, min_scale=2.0))
    scales = []
    for i in range(4):
        state, _ = step(state, regression_batch(seed=i))
        scales.append(float(state.loss_scale.scale))
    assert scales == [4.0, 4.0, 8.0, 8.0]
    for _ in range(3):
        state, _ = step(state, _overflow())
        scales.append(float(state.loss_scale.scale))
    assert scales[4:] == [4.0, 2.0, 2.0] and int(state.skips.skipped) == 3


def test_gradients_are_unscaled_before_the_update():
    """SGD's update is the true gradient: two float16 steps with very different scales give
    the same params (the scales are powers of two: unscaling is exact)."""
    results = []
    for initial in (1.0, 2.0**12):
        model = mlp(seed=4)
        step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="aot_eager",
                                precision=fsg.Policy(compute=torch.float16, loss_scale=DynamicLossScale(initial=initial)))  # fmt: skip
        state, _ = step(step.init(fsg.params(model)), regression_batch())
        results.append(state.params)
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-3, atol=1e-4)


def test_save_and_restore_keep_the_scale(tmp_path):
    step, state = _step(DynamicLossScale(initial=64.0, growth_interval=5))
    for i in range(3):
        state, _ = step(state, _overflow() if i == 1 else regression_batch(seed=i))
    fsg.checkpoint.save(tmp_path / "ckpt", state)
    _, fresh = _step(DynamicLossScale(initial=64.0, growth_interval=5))
    restored = fsg.checkpoint.restore(tmp_path / "ckpt", like=fresh)
    assert float(restored.loss_scale.scale) == 32.0 and int(restored.loss_scale.good_steps) == 1
    assert int(restored.skips.skipped) == 1
    a, ma = step(state, regression_batch(seed=9))
    b, mb = step(restored, regression_batch(seed=9))
    assert torch.equal(ma["loss"], mb["loss"]) and float(ma["loss_scale"]) == float(mb["loss_scale"]) == 32.0


@pytest.mark.parametrize("fused", [False, True])
def test_float16_trains_close_to_float32(fused):
    losses = {}
    for compute in (torch.float32, torch.float16):
        model = mlp(seed=5)
        step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), backend="aot_eager",
                                precision=fsg.Policy(compute=compute), fused_optimizer=fused)  # fmt: skip
        state = step.init(fsg.params(model))
        curve = []
        for i in range(40):
            x = regression_batch(n=64, seed=i % 4)["x"]
            state, m = step(state, {"x": x, "y": torch.tanh(x[:, :4] - x[:, 4:])})  # learnable
            curve.append(float(m["loss"]))
        losses[compute] = curve
    fp32, fp16 = losses[torch.float32], losses[torch.float16]
    assert fp16[-1] < 0.5 * fp16[0]  # it learns
    assert max(abs(a - b) / a for a, b in zip(fp32, fp16)) < 0.02
