"""The default backend: the whole step compiled by Inductor (C++ kernels on CPU)."""

import pytest
import torch

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch, rel_err

pytestmark = pytest.mark.inductor


def test_inductor_step_matches_aot_eager_and_donates():
    states = {}
    for backend in ("aot_eager", "inductor"):
        model = mlp()
        step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), backend=backend)
        state = step.init(fsg.params(model))
        ptrs = [t.data_ptr() for t in fsg._src.tree.flatten(state)[0]]
        for i in range(5):
            state, metrics = step(state, regression_batch(seed=i))
        assert [t.data_ptr() for t in fsg._src.tree.flatten(state)[0]] == ptrs
        assert step.num_compiles == 1
        states[backend] = state
    for k in states["aot_eager"].params:
        assert rel_err(states["inductor"].params[k], states["aot_eager"].params[k]) < 1e-5, k
    assert torch.equal(states["inductor"].step, states["aot_eager"].step)


def test_a_batch_with_other_strides_compiles_again_and_matches():
    """Inductor specializes on strides; a transposed batch of the same shape gets its own
    compile (as torch.compile's guards would) instead of failing a stride assertion."""
    states = {}
    for backend in ("aot_eager", "inductor"):
        model = mlp()
        step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), backend=backend)
        state = step.init(fsg.params(model))
        for i in range(3):
            batch = regression_batch(seed=i)
            if i == 1:  # the same values and shape, column-major
                batch = {k: v.t().contiguous().t() for k, v in batch.items()}
                assert not batch["x"].is_contiguous()
            state, _ = step(state, batch)
        states[backend] = state
    for k in states["aot_eager"].params:
        assert rel_err(states["inductor"].params[k], states["aot_eager"].params[k]) < 1e-5, k
