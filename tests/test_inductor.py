"""The default backend: the whole step compiled by Inductor (C++ kernels on CPU)."""

import operator

import pytest
import torch

import fsg
from fsg._src.backend import inductor
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


def _attention_graph() -> torch.fx.GraphModule:
    """q, k, v -> the efficient attention's output, with its RNG state read by a later node
    (as the backward reads it); built by hand: the op has no CPU kernel."""
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    attn = g.call_function(torch.ops.aten._scaled_dot_product_efficient_attention.default, (q, k, v, None, True))
    out, seed, offset = (g.call_function(operator.getitem, (attn, i)) for i in (0, 2, 3))
    g.call_function(torch.ops.aten.add.Tensor, (seed, offset))
    g.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_attention_rng_state_is_returned_so_inductor_never_reuses_its_buffer():
    gm = _attention_graph()
    assert [n.args[1] for n in inductor.rng_state_nodes(gm)] == [2, 3]
    assert inductor.keep_rng_state_alive(gm) == 1
    (returned,) = [n for n in gm.graph.nodes if n.op == "output"][0].args
    assert [n.args[1] for n in returned] == [0, 2, 3]
    plain = torch.fx.symbolic_trace(lambda x: (x + 1,))
    assert inductor.keep_rng_state_alive(plain) is None


def test_inductor_step_drops_the_outputs_it_added(monkeypatch):
    # The CPU has no attention kernel that returns RNG state; sort's "indices" stands in for it.
    monkeypatch.setattr(inductor, "RNG_STATE_RETURNS", frozenset({"indices"}))
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    x = gm.graph.placeholder("x")
    sort = gm.graph.call_function(torch.ops.aten.sort.default, (x,))
    values, indices = (gm.graph.call_function(operator.getitem, (sort, i)) for i in (0, 1))
    gm.graph.output((gm.graph.call_function(torch.ops.aten.add.Tensor, (values, indices)),))
    gm.recompile()
    step = inductor.InductorStep(gm)
    assert len([n for n in gm.graph.nodes if n.op == "output"][0].args[0]) == 1  # the caller's graph unchanged
    t = torch.randn(5)
    for _ in range(2):  # the first call compiles, the second replays
        (out,) = step(t)
        assert torch.equal(out, torch.sort(t).values + torch.sort(t).indices)
