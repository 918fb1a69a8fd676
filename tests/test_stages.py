"""Step.lower: the graph as text, op counts and the FLOPs estimate."""

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch


def test_cost_counts_forward_and_backward_matmul_flops():
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adam(1e-3), backend="aot_eager")
    state = step.init(fsg.params(model))
    cost = step.lower(state, regression_batch(n=16)).cost()
    fwd = 2 * 16 * (8 * 32 + 32 * 4)
    # backward: weight grads of both layers and the input grad of the second layer.
    bwd = 2 * 16 * (8 * 32 + 32 * 4) + 2 * 16 * 32 * 4
    assert cost.flops == fwd + bwd
    assert cost.op_counts["aten.mm"] == 3


def test_lower_does_not_run_nor_compile():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    state = step.init(fsg.params(model))
    before = [t.clone() for t in fsg._src.tree.flatten(state)[0]]
    text = step.lower(state, regression_batch()).as_text()
    assert "aten.addmm" in text and "f32[16, 8]" in text
    assert step.num_compiles == 0
    for a, b in zip(before, fsg._src.tree.flatten(state)[0]):
        assert (a == b).all()
