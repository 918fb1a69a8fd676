"""fsg.compile_eval: an evaluation step with modules in eval mode (dropout off, BatchNorm on its
running statistics), compiled and cached apart from the train step (issue 21)."""

import copy

import pytest
import torch
from torch import nn

import fsg
from fsg._src import tree


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    model[1].running_mean.uniform_(-1, 1)  # statistics far from the batch's: eval mode shows
    model[1].running_var.uniform_(0.5, 2.0)
    return model


def _batch(rows=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, 4, generator=g), "y": torch.randint(0, 3, (rows,), generator=g)}


def _train_step(model, calls=None, **kw):
    def loss_fn(params, batch, buffers):
        if calls is not None:
            calls.append("train")
        logits = fsg.apply(model, params, batch["x"], buffers=buffers)
        return torch.nn.functional.cross_entropy(logits, batch["y"])

    return fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(1e-2), backend="eager", **kw)


def _eager_eval(model, state, x):
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict({**state.params, **state.buffers})
    with torch.no_grad():
        return reference(x)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_eval_equals_eager_eval_mode_and_leaves_the_state_untouched(backend):
    model = _model()
    step = _train_step(model)
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    before = tree.tree_map(torch.clone, state)
    ev = fsg.compile_eval(lambda params, batch, buffers: fsg.apply(model, params, batch["x"], buffers=buffers),
                          backend=backend)  # fmt: skip
    batch = _batch()
    logits = ev(state, batch)
    torch.testing.assert_close(logits, _eager_eval(model, state, batch["x"]), rtol=1e-5, atol=1e-6)
    assert torch.equal(ev(state, batch), logits)  # dropout off: deterministic
    for a, b in zip(tree.flatten(state)[0], tree.flatten(before)[0]):
        assert torch.equal(a, b), "the evaluation wrote to the state"
    assert model.training and all(m.training for m in model.modules())  # the module's mode is restored


def test_eval_in_a_training_loop_recompiles_nothing_and_changes_no_step():
    model, calls = _model(), []

    def metrics(params, batch, buffers):
        calls.append("eval")
        logits = fsg.apply(model, params, batch["x"], buffers=buffers)
        return {"accuracy": (logits.argmax(-1) == batch["y"]).float().mean(),
                "loss": torch.nn.functional.cross_entropy(logits, batch["y"])}  # fmt: skip

    step, ev = _train_step(model, calls), fsg.compile_eval(metrics, backend="eager")
    plain = _train_step(model)  # the same run without evaluations
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    plain_state = plain.init(fsg.params(model), buffers=fsg.buffers(model))
    for i in range(4):
        state, m = step(state, _batch(seed=i))
        plain_state, plain_m = plain(plain_state, _batch(seed=i))
        assert torch.equal(m["loss"], plain_m["loss"])
        out = ev(state, _batch(seed=100))
        assert sorted(out) == ["accuracy", "loss"]
        logits = _eager_eval(model, state, _batch(seed=100)["x"])
        expected = torch.nn.functional.cross_entropy(logits, _batch(seed=100)["y"])
        torch.testing.assert_close(out["loss"], expected, rtol=1e-5, atol=1e-6)
    assert calls == ["train", "eval"]  # each traced once
    assert step.num_compiles == 1 and ev.num_compiles == 1
    for name in state.buffers:
        assert torch.equal(state.buffers[name], plain_state.buffers[name]), name


def test_a_new_batch_shape_recompiles_the_eval_with_a_warning_or_raises_under_strict():
    model = _model()
    state = _train_step(model).init(fsg.params(model), buffers=fsg.buffers(model))

    def fn(params, batch, buffers):
        return fsg.apply(model, params, batch["x"], buffers=buffers).sum()

    ev = fsg.compile_eval(fn, backend="eager")
    ev(state, _batch(8))
    with pytest.warns(fsg.RecompileWarning, match=r"batch\['x'\]: float32\[8, ?4\] -> float32\[16, ?4\]"):
        ev(state, _batch(16))
    assert ev.num_compiles == 2
    strict = fsg.compile_eval(fn, backend="eager", strict=True)
    strict(state, _batch(8))
    with pytest.raises(fsg.RecompileError):
        strict(state, _batch(16))


class _Counter(nn.Module):
    """Writes a buffer in eval mode too: the evaluation must write a copy."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)
        return x * self.seen


def test_a_module_writing_a_buffer_in_eval_mode_does_not_write_the_state():
    model = nn.Sequential(nn.Linear(4, 2), _Counter())
    state = _train_step(model).init(fsg.params(model), buffers=fsg.buffers(model))
    ev = fsg.compile_eval(lambda p, b, bufs: fsg.apply(model, p, b["x"], buffers=bufs), backend="eager")
    out = ev(state, _batch())
    torch.testing.assert_close(out, fsg.apply(model, state.params, _batch()["x"], buffers={"1.seen": torch.zeros(())}))
    assert state.buffers["1.seen"].item() == 0


def test_eval_errors_name_the_rule():
    model = _model()
    state = _train_step(model).init(fsg.params(model), buffers=fsg.buffers(model))
    with pytest.raises(fsg.LossNotScalarError, match="a tensor or a dict"):
        fsg.compile_eval(lambda p, b, bufs: [fsg.apply(model, p, b["x"], buffers=bufs)], backend="eager")(
            state, _batch()
        )

    def host(p, b, bufs):
        return fsg.apply(model, p, b["x"], buffers=bufs) * b["x"].sum().item()

    with pytest.raises(fsg.HostSyncError, match="test_eval.py"):
        fsg.compile_eval(host, backend="eager")(state, _batch())
    with pytest.raises(TypeError, match="TrainState"):
        fsg.compile_eval(host, backend="eager")(state.params, _batch())
