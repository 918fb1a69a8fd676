"""Stage 1 is functional (issue 15): the traced step writes only in its epilogue, one
``copy_`` into each written state input at the end, nothing read after it; a loss or module
that works in place is functionalized by torch and still computes what eager PyTorch does."""

import pytest
import torch
from torch import fx, nn

import fsg
from fsg._src import _torch_private
from fsg._src.errors import PassInvariantError
from fsg._src.trace import epilogue
from tests.helpers import mlp, mse_loss_fn, regression_batch
from tests.test_buffers import _batches, _eager, _loss


class InPlaceNet(nn.Module):
    """In-place ops on activations and a buffer counter updated with ``add_``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = self.fc1(x)
        h.mul_(2.0)
        h.relu_()
        self.calls.add_(1)
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return self.fc2(h)


def _bn_model():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


@pytest.mark.parametrize("make", [InPlaceNet, _bn_model], ids=["in-place", "batchnorm"])
@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_in_place_modules_trace_to_an_epilogue_and_equal_eager(make, donate, skip, accum_steps):
    torch.manual_seed(0)
    model = make()
    step = fsg.compile_step(
        _loss(model),
        optimizer=fsg.optim.sgd(0.1),
        backend="eager",
        donate=donate,
        skip_nonfinite=skip,
        accum_steps=accum_steps,
    )
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    batches = _batches()
    traced = step.lower(state, batches[0]).stages["traced"]
    assert epilogue.first_stray_write(traced) is None
    assert not any(n.target is torch.ops.aten.native_batch_norm.default for n in traced.graph.nodes)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
    if accum_steps == 1:  # eager PyTorch runs the whole batch at once
        eager, expected = _eager(model, batches)
        assert losses == pytest.approx(expected, rel=1e-5)
        for name, value in eager.named_buffers():
            torch.testing.assert_close(state.buffers[name], value, rtol=1e-5, atol=1e-6)


def test_a_step_that_writes_nothing_in_place_is_not_traced_again(monkeypatch):
    calls = []
    real = _torch_private.functionalize
    monkeypatch.setattr(_torch_private, "functionalize", lambda gm, *rest: calls.append(gm) or real(gm, *rest))
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-3), backend="eager")
    traced = step.lower(step.init(fsg.params(model)), regression_batch()).stages["traced"]
    assert epilogue.first_stray_write(traced) is None and calls == []
    bn = _bn_model()
    step = fsg.compile_step(_loss(bn), optimizer=fsg.optim.adamw(1e-3), backend="eager")
    step.lower(step.init(fsg.params(bn), buffers=fsg.buffers(bn)), _batches(1)[0])
    assert len(calls) == 1  # BatchNorm writes its running statistics: functionalized


def _graph(build):
    g = fx.Graph()
    p, q = g.placeholder("p"), g.placeholder("q")
    out = build(g, p, q)
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g)


def _mul(g, x):
    return g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))


def _copy(g, dst, src):
    return g.call_function(torch.ops.aten.copy_.default, (dst, src))


@pytest.mark.parametrize(
    "build, stray",
    [
        (lambda g, p, q: (_copy(g, p, _mul(g, q)), (_mul(g, q),))[1], None),  # the epilogue form
        (lambda g, p, q: (_copy(g, p, _mul(g, q)), (_mul(g, p),))[1], "mul_tensor_1"),  # read after its write
        (lambda g, p, q: (g.call_function(torch.ops.aten.relu_.default, (p,)), (q,))[1], "relu__default"),
        (lambda g, p, q: (_copy(g, p, q), _copy(g, p, q), (q,))[2], "copy__default_1"),  # written twice
        (lambda g, p, q: (_copy(g, p, q), (p,))[1], "output"),  # the output reads p after its write
        (lambda g, p, q: (_copy(g, g.call_function(torch.ops.aten.t.default, (p,)), q), (q,))[1], "copy__default"),
    ],
    ids=["epilogue", "read-after-write", "in-place-op", "written-twice", "output-reads", "write-into-view"],
)
def test_the_epilogue_form_on_hand_built_graphs(build, stray):
    gm = _graph(build)
    found = epilogue.first_stray_write(gm)
    assert (found.name if found is not None else None) == stray
    if stray is None:
        epilogue.check(gm)
    else:
        with pytest.raises(PassInvariantError, match=stray):
            epilogue.check(gm)
