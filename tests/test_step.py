"""compile_step: one graph, the compile cache, donation and metrics."""

import warnings

import pytest
import torch

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch


def make_step(model, **kwargs):
    kwargs.setdefault("optimizer", fsg.optim.adamw(1e-2))
    kwargs.setdefault("backend", "aot_eager")
    return fsg.compile_step(mse_loss_fn(model), **kwargs)


def test_one_graph_holds_forward_backward_and_adam():
    model = mlp()
    step = make_step(model)
    state = step.init(fsg.params(model))
    lowered = step.lower(state, regression_batch())
    ops = lowered.op_counts()
    # forward: 2 matmuls (addmm); backward: 3 more (two weight grads, one input grad).
    assert ops["aten.addmm"] == 2 and ops["aten.mm"] == 3
    assert ops["aten.tanh"] == 1 and ops["aten.tanh_backward"] == 1
    # Adam's update: a sqrt and a division per parameter (4 params), plus bias corrections.
    assert ops["aten.sqrt"] >= 4 and ops["aten.div"] >= 4
    # donation: each of the 17 state leaves that changes is written back in place.
    assert ops["aten.copy_"] == 17
    text = lowered.as_text()
    assert "torch.ops.aten.tanh_backward.default" in text and "torch.ops.aten.sqrt.default" in text
    # It is one graph: a single FX graph module, no calls out to sub-graphs.
    assert all(n.op in ("placeholder", "call_function", "output", "get_attr") for n in lowered.graph_module.graph.nodes)


def test_metrics_are_0d_tensors_on_the_state_device():
    model = mlp()
    step = make_step(model)
    state = step.init(fsg.params(model))
    state, metrics = step(state, regression_batch())
    assert sorted(metrics) == ["grad_norm", "loss", "lr"]
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.device == state.step.device
    assert float(metrics["lr"]) == pytest.approx(1e-2)
    expected = ((fsg.apply(model, fsg.params(model), regression_batch()["x"]) - regression_batch()["y"]) ** 2).mean()
    assert float(metrics["loss"]) == pytest.approx(float(expected), rel=1e-6)


def test_aux_outputs_become_metrics():
    model = mlp()

    def loss_fn(params, batch):
        out = fsg.apply(model, params, batch["x"])
        err = out - batch["y"]
        return (err**2).mean(), {"mae": err.abs().mean()}

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    _, metrics = step(step.init(fsg.params(model)), regression_batch())
    assert sorted(metrics) == ["grad_norm", "loss", "lr", "mae"]
    assert float(metrics["mae"]) > 0


def test_schedule_changes_lr_without_recompiling():
    model = mlp()
    schedule = fsg.optim.warmup_cosine(1e-2, warmup=3, total=10)
    step = make_step(model, optimizer=fsg.optim.adamw(schedule), strict=True)
    state = step.init(fsg.params(model))
    lrs = []
    for i in range(8):
        state, metrics = step(state, regression_batch(seed=i))
        lrs.append(float(metrics["lr"]))
    assert step.num_compiles == 1
    assert len(set(lrs)) == 8  # a different learning rate at every step
    assert lrs == pytest.approx([float(schedule(i)) for i in range(8)])


def test_new_batch_shape_recompiles_once_with_a_warning_naming_the_leaf():
    model = mlp()
    step = make_step(model)
    state = step.init(fsg.params(model))
    state, _ = step(state, regression_batch(n=16))
    with pytest.warns(fsg.RecompileWarning, match=r"batch\['x'\]: float32\[16,8\] -> float32\[4,8\]") as record:
        state, _ = step(state, regression_batch(n=4))
        state, _ = step(state, regression_batch(n=4))
    assert len(record) == 1
    assert step.num_compiles == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, _ = step(state, regression_batch(n=16))  # both signatures are cached
    assert step.num_compiles == 2


def test_strict_mode_raises_on_a_cache_miss():
    model = mlp()
    step = make_step(model, strict=True)
    state = step.init(fsg.params(model))
    state, _ = step(state, regression_batch(n=16))
    with pytest.raises(fsg.RecompileError, match=r"batch\['y'\]: float32\[16,4\] -> float32\[8,4\]"):
        step(state, regression_batch(n=8))


def test_new_dtype_of_a_state_leaf_recompiles_naming_it():
    model = mlp()
    step = make_step(model, optimizer=fsg.optim.sgd(0.1), strict=True)
    state = step.init(fsg.params(model))
    state, _ = step(state, regression_batch())
    params = dict(state.params)
    params["0.bias"] = params["0.bias"].double()
    with pytest.raises(fsg.RecompileError, match=r"state.params\['0.bias'\]: float32\[32\] -> float64\[32\]"):
        step(state._replace(params=params), regression_batch())


def test_donation_updates_state_storages_in_place():
    model = mlp()
    step = make_step(model, donate=True)
    state = step.init(fsg.params(model))
    leaves = fsg._src.tree.flatten(state)[0]
    before = [(t, t.untyped_storage().data_ptr(), t.clone()) for t in leaves]
    new_state, _ = step(state, regression_batch())
    new_leaves = fsg._src.tree.flatten(new_state)[0]
    for (old, ptr, _), new in zip(before, new_leaves):
        assert new is old
        assert new.untyped_storage().data_ptr() == ptr
    assert not torch.equal(before[1][2], new_leaves[1])  # values did change
    assert int(new_state.step) == 1


def test_without_donation_the_old_state_is_untouched():
    model = mlp()
    step = make_step(model, donate=False)
    state = step.init(fsg.params(model))
    snapshot = [t.clone() for t in fsg._src.tree.flatten(state)[0]]
    new_state, _ = step(state, regression_batch())
    for old, saved in zip(fsg._src.tree.flatten(state)[0], snapshot):
        assert torch.equal(old, saved)
    assert int(new_state.step) == 1 and int(state.step) == 0
    assert not torch.equal(new_state.params["0.weight"], state.params["0.weight"])


def test_donated_and_undonated_steps_agree():
    results = []
    for donate in (True, False):
        model = mlp()
        step = make_step(model, donate=donate)
        state = step.init(fsg.params(model))
        for i in range(5):
            state, metrics = step(state, regression_batch(seed=i))
        results.append((state, float(metrics["loss"])))
    (a, loss_a), (b, loss_b) = results
    assert loss_a == loss_b
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k])


def test_init_copies_params_and_the_model_is_untouched():
    model = mlp()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    step = make_step(model)
    state = step.init(fsg.params(model), seed=7)
    state, _ = step(state, regression_batch())
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k])
    assert state.rng.tolist() == [7, 1]


def test_eager_backend_matches_aot_eager():
    losses = {}
    for backend in ("eager", "aot_eager"):
        model = mlp()
        step = make_step(model, backend=backend)
        state = step.init(fsg.params(model))
        for i in range(3):
            state, metrics = step(state, regression_batch(seed=i))
        losses[backend] = (float(metrics["loss"]), state.params["2.weight"].clone())
    assert losses["eager"][0] == pytest.approx(losses["aot_eager"][0], rel=1e-6)
    assert torch.allclose(losses["eager"][1], losses["aot_eager"][1], rtol=1e-6, atol=1e-7)


def test_buffers_are_passed_to_the_loss():
    model = mlp()
    scale = {"s": torch.tensor(2.0)}

    def loss_fn(params, batch, buffers):
        out = fsg.apply(model, params, batch["x"]) * buffers["s"]
        return ((out - batch["y"]) ** 2).mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    state = step.init(fsg.params(model), buffers=scale)
    _, metrics = step(state, regression_batch())
    expected = (
        (fsg.apply(model, fsg.params(model), regression_batch()["x"]) * 2 - regression_batch()["y"]) ** 2
    ).mean()
    assert float(metrics["loss"]) == pytest.approx(float(expected), rel=1e-6)


def test_mesh_must_be_an_fsg_mesh():
    with pytest.raises(fsg.FsgError, match=r"compile_step\(mesh=...\) must be an fsg.Mesh or None; got str"):
        fsg.compile_step(lambda p, b: p, "dp=2", optimizer=fsg.optim.sgd(0.1))


def test_unknown_backend_is_refused():
    with pytest.raises(fsg.FsgError, match="unknown backend 'xla'"):
        fsg.compile_step(lambda p, b: p, optimizer=fsg.optim.sgd(0.1), backend="xla")


def test_cuda_graph_true_on_cpu_says_why_not():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-3), cuda_graph=True)
    with pytest.raises(fsg.UnsupportedError, match="not a CUDA tensor"):
        step(step.init(fsg.params(model)), regression_batch())


@pytest.mark.parametrize("options", [dict(), dict(num_layers=2, bidirectional=True), dict(proj_size=3)])
def test_an_lstm_trains_as_eager_pytorch(options):
    """nn.LSTM on CPU: torch's decomposition took oneDNN's mkldnn_rnn_layer, whose backward traced
    on fake tensors got no workspace (a torch error when the step ran); stage 1 traces with
    oneDNN off (trace/purity.py), and the step equals eager PyTorch's."""
    import copy

    torch.manual_seed(0)
    rnn = torch.nn.LSTM(5, 6, batch_first=True, **options)
    reference = copy.deepcopy(rnn)
    step = fsg.compile_step(lambda p, b: fsg.apply(rnn, p, b["x"])[0].square().mean(),
                            optimizer=fsg.optim.sgd(0.1), backend="eager")  # fmt: skip
    state = step.init(fsg.params(rnn))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(3, 4, 5, generator=g)
        state, metrics = step(state, {"x": x})
        opt.zero_grad()
        loss = reference(x)[0].square().mean()
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-7)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert torch.backends.mkldnn.enabled  # restored after the trace
