"""Buffers are state: a module's in-place buffer updates (BatchNorm's running statistics) come
back as the new state, written like params under donation and never into the inputs without
it (issue 21)."""

import copy

import pytest
import torch
from torch import nn

import fsg
from fsg._src import tree


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _loss(model):
    def loss_fn(params, batch, buffers):
        out = fsg.apply(model, params, batch["x"], buffers=buffers)
        return ((out - batch["y"]) ** 2).mean()

    return loss_fn


def _batches(n=3, rows=16):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, 4, generator=g), "y": torch.randn(rows, 1, generator=g)} for _ in range(n)]


def _eager(model, batches, lr=0.1):
    """The same steps in eager PyTorch: SGD on the module, BatchNorm in train mode."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = ((model(b["x"]) - b["y"]) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_running_statistics_match_eager_pytorch_and_inputs_stay_untouched(donate, accum_steps):
    model, batches = _model(), _batches()
    step = fsg.compile_step(_loss(model), optimizer=fsg.optim.sgd(0.1), backend="eager", donate=donate)
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    if accum_steps == 2:  # two microbatches of 8 rows each: BatchNorm sees each in turn
        step = fsg.compile_step(
            _loss(model), optimizer=fsg.optim.sgd(0.1), backend="eager", donate=donate, accum_steps=2
        )
        state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    first = tree.tree_map(torch.clone, state)
    inputs = state
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
    if not donate:
        for a, b in zip(tree.flatten(inputs)[0], tree.flatten(first)[0]):
            assert torch.equal(a, b), "donate=False changed an input leaf"
    if accum_steps == 1:
        eager, eager_losses = _eager(model, batches)
        assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
        for name, value in fsg.buffers(eager).items():
            torch.testing.assert_close(state.buffers[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert state.buffers["1.num_batches_tracked"].item() == len(batches) * accum_steps


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_donation_writes_buffers_in_place_and_unchanged_buffers_are_not_copied(skip_nonfinite):
    model = _model()

    def loss_fn(params, batch, buffers):
        out = fsg.apply(model, params, batch["x"], buffers={k: v for k, v in buffers.items() if k != "scale"})
        return ((out * buffers["scale"] - batch["y"]) ** 2).mean()

    # Stage 1 is functional, so with skipping too a buffer only read is never written back.
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager", skip_nonfinite=skip_nonfinite)
    buffers = {**fsg.buffers(model), "scale": torch.tensor(2.0)}
    state = step.init(fsg.params(model), buffers=buffers)
    mean = state.buffers["1.running_mean"]
    before = mean.clone()
    new, _ = step(state, _batches(1)[0])
    assert new.buffers["1.running_mean"] is mean and not torch.equal(mean, before)  # written in place
    graph = step.lower(new, _batches(1)[0]).graph_module.graph
    written = {n.args[0].name for n in graph.nodes if n.target is torch.ops.aten.copy_.default}
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    leaves = tree.leaf_paths(new, "state")
    scale = placeholders[leaves.index("state.buffers['scale']")]
    assert scale not in written  # read, never written: no copy


@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm1d(4), lambda: nn.BatchNorm1d(4, momentum=None)])
def test_a_buffer_written_but_not_in_the_state_is_refused_with_the_fix(norm):
    """BatchNorm in training mode updates its running statistics in place; where its buffers
    are not in the state, the graph holds them as constants. The step says so, at the user's
    line, with the fix, instead of torch's internal assert from functionalization."""
    model = nn.Sequential(nn.Linear(3, 4), norm(), nn.Linear(4, 2))
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b["x"]).square().mean(),  # no buffers given
                            optimizer=fsg.optim.sgd(0.1), backend="eager")  # fmt: skip
    with pytest.raises(fsg.ImpureLossError) as info:
        step(step.init(fsg.params(model)), {"x": torch.randn(8, 3)})
    message = str(info.value)
    assert "writes in place" in message and "a tensor the step was not given" in message and "test_buffers.py" in message
    assert "step.init(params, buffers=fsg.buffers(model))" in message and "buffers=buffers" in message
    model.eval()  # the fix the message names last: in eval mode BatchNorm writes nothing
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b["x"]).square().mean(),
                            optimizer=fsg.optim.sgd(0.1), backend="eager")  # fmt: skip
    step(step.init(fsg.params(model)), {"x": torch.randn(8, 3)})


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("param", [torch.float32, torch.float64])
def test_buffers_follow_their_params_to_the_param_dtype(model_dtype, param):
    """A model in another floating dtype (a bfloat16 checkpoint, a float64 model) under a
    ``Policy(param=...)``: ``step.init`` casts its params, and its buffers of the model's dtype
    go with them (a BatchNorm's running statistics and its weight must agree); a buffer of
    another dtype and the integer counter keep theirs. The steps equal eager PyTorch on the
    model moved to the param dtype with ``.to()``, which moves params and buffers alike."""
    model = _model().to(model_dtype)
    model.register_buffer("extra", torch.ones(8))  # float32: none of the model dtypes drawn
    step = fsg.compile_step(_loss(model), optimizer=fsg.optim.sgd(0.1), backend="eager",
                            precision=fsg.Policy(param=param, compute=param))  # fmt: skip
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    assert {p.dtype for p in state.params.values()} == {param} and state.buffers["1.running_mean"].dtype == param
    assert state.buffers["extra"].dtype == torch.float32 and state.buffers["1.num_batches_tracked"].dtype == torch.int64
    batches = [{k: v.to(param) for k, v in b.items()} for b in _batches()]
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
    _, eager_losses = _eager(model.to(param), batches)
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("donate", [True, False])
def test_a_module_that_renormalizes_its_weight_in_place_steps_as_eager(donate):
    """``nn.Embedding(max_norm=...)`` renormalizes the rows it reads in place, under
    ``no_grad``, before the lookup; eager PyTorch's optimizer then updates the renormalized
    weight. The step does the same, and with ``donate=False`` leaves its input state as it was
    (the write lives in the returned state only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Flatten(), nn.Linear(40, 1))
    reference = copy.deepcopy(model)
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b).square().mean(), optimizer=fsg.optim.sgd(0.5),
                            backend="eager", donate=donate)  # fmt: skip
    state = step.init(fsg.params(model))
    before = tree.tree_map(torch.clone, state)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x in torch.randint(0, 20, (3, 4, 5), generator=torch.Generator().manual_seed(2)):
        inputs = state
        state, _ = step(state, x)
        opt.zero_grad()
        reference(x).square().mean().backward()
        opt.step()
        if not donate:
            for a, b in zip(tree.flatten(inputs)[0], tree.flatten(before)[0]):
                assert torch.equal(a, b), "donate=False changed an input leaf"
            before = tree.tree_map(torch.clone, state)
    for name, value in reference.named_parameters():
        torch.testing.assert_close(state.params[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
