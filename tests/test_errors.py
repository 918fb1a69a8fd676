"""Every user mistake gets its fsg error, naming the leaf or source line and the fix."""

import logging

import pytest
import torch

import fsg
from tests.helpers import mlp, regression_batch

THIS_FILE = __file__.removesuffix("c")


def run_once(loss_fn, batch=None, **kwargs):
    model_params = fsg.params(mlp())
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager", **kwargs)
    return step(step.init(model_params), regression_batch() if batch is None else batch)


MODEL = mlp()


def forward(params, batch):
    return fsg.apply(MODEL, params, batch["x"])


def test_in_place_update_of_a_param_names_the_leaf_and_line():
    def loss_fn(params, batch):
        params["0.weight"].mul_(2)  # the offending line
        return forward(params, batch).mean()

    with pytest.raises(fsg.ImpureLossError) as info:
        run_once(loss_fn)
    message = str(info.value)
    assert "params['0.weight']" in message and "aten.mul_" in message
    assert THIS_FILE in message and "the offending line" in message
    assert "out-of-place" in message


def test_in_place_update_of_a_batch_leaf_names_the_leaf():
    def loss_fn(params, batch):
        batch["x"].add_(1.0)
        return forward(params, batch).mean()

    with pytest.raises(fsg.ImpureLossError, match=r"batch\['x'\] \(aten.add_\)"):
        run_once(loss_fn)


def test_item_in_the_loss_names_the_line():
    def loss_fn(params, batch):
        out = forward(params, batch)
        scale = out.abs().max().item()  # host sync
        return out.mean() / scale

    with pytest.raises(fsg.HostSyncError) as info:
        run_once(loss_fn)
    assert "host sync" in str(info.value) and THIS_FILE in str(info.value)
    assert "torch.where" in str(info.value)


def test_data_dependent_control_flow_names_the_line():
    def loss_fn(params, batch):
        out = forward(params, batch)
        if out.mean() > 0:  # data-dependent branch
            return out.mean()
        return -out.mean()

    with pytest.raises(fsg.HostSyncError) as info:
        run_once(loss_fn)
    assert "data-dependent branch" in str(info.value) and "control flow" in str(info.value)


def test_a_tensor_used_as_a_size_is_a_host_sync_error():
    # A size read from a tensor's value (packed RNN sequences, which did this, are traced now:
    # tests/test_packed_sequences.py); the error names the line.
    lin = torch.nn.Linear(4, 4)

    def loss_fn(params, batch):
        return fsg.apply(lin, params, batch["x"]).expand(batch["n"], -1, -1).square().mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    with pytest.raises(fsg.HostSyncError, match="needs the value of a tensor on the host") as info:
        step(step.init(fsg.params(lin)), {"x": torch.randn(3, 4), "n": torch.tensor(2)})
    assert "test_errors.py" in str(info.value) and '.expand(batch["n"], -1, -1)' in str(info.value)


def test_a_loss_typed_at_the_prompt_is_located_by_its_line():
    import subprocess
    import sys

    code = (
        "import torch, fsg\n"
        "def loss_fn(params, x):\n"
        "    return (x @ params['w']).expand(x.sum().long(), -1, -1).mean()\n"
        "step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend='eager')\n"
        "step(step.init({'w': torch.ones(2, 2)}), torch.ones(3, 2))\n"
    )
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300)
    assert 'HostSyncError' in out.stderr and 'File "<stdin>", line 3' in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "bad, what",
    [
        (lambda out: out, r"shape \(16, 4\)"),
        (lambda out: 3.0, "a float"),
        (lambda out: out.mean() > 0, "torch.bool"),
    ],
)
def test_loss_that_is_not_a_scalar(bad, what):
    def loss_fn(params, batch):
        return bad(forward(params, batch))

    with pytest.raises(fsg.LossNotScalarError, match=what):
        run_once(loss_fn)


def test_aux_that_is_not_a_dict_of_tensors():
    def loss_fn(params, batch):
        return forward(params, batch).mean(), {"n": 3}

    with pytest.raises(fsg.LossNotScalarError, match="the aux metric 'n' returned by loss_fn is a int"):
        run_once(loss_fn)


def test_aux_that_shadows_a_builtin_metric():
    def loss_fn(params, batch):
        loss = forward(params, batch).mean()
        return loss, {"loss": loss}

    with pytest.raises(fsg.LossNotScalarError, match="'loss', which names a built-in metric"):
        run_once(loss_fn)


def test_non_tensor_leaf_in_the_batch():
    with pytest.raises(fsg.NonTensorLeafError, match=r"batch\['lr'\] is a float \(0.1\)"):
        run_once(lambda p, b: forward(p, b).mean(), batch={**regression_batch(), "lr": 0.1})


def test_non_tensor_leaf_in_the_state():
    model = mlp()
    step = fsg.compile_step(lambda p, b: forward(p, b).mean(), optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    state = step.init(fsg.params(model))
    bad = state._replace(step=5)
    with pytest.raises(fsg.NonTensorLeafError, match=r"state.step is a int \(5\)"):
        step(bad, regression_batch())


def test_non_tensor_leaf_in_params_at_init():
    step = fsg.compile_step(lambda p, b: p["w"].sum(), optimizer=fsg.optim.sgd(0.1))
    with pytest.raises(fsg.NonTensorLeafError, match=r"params\['n'\] is a str"):
        step.init({"w": torch.ones(2), "n": "hello"})


def test_batch_with_another_structure_names_the_keys():
    model = mlp()
    step = fsg.compile_step(lambda p, b: forward(p, b).mean(), optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    state = step.init(fsg.params(model))
    state, _ = step(state, regression_batch())
    with pytest.raises(
        fsg.StructureMismatchError, match=r"missing \[\"batch\['y'\]\"\], unexpected \[\"batch\['z'\]\"\]"
    ):
        step(state, {"x": torch.randn(16, 8), "z": torch.randn(16, 4)})
    # The failed call lost nothing: the state still steps.
    state, metrics = step(state, regression_batch())
    assert int(state.step) == 2 and torch.isfinite(metrics["loss"])


def test_a_shape_bug_in_the_loss_raises_torch_error_once_at_the_users_line(caplog):
    """torch's own error, its traceback through the user's line, and none of the fake tensor's
    ERROR log of the failed meta call (some fifty lines of torch internals) while fsg traces."""

    def loss_fn(params, batch):
        return (fsg.apply(mlp(), params, batch["x"]) + torch.ones(3, 5)).sum()  # shapes don't broadcast

    with caplog.at_level("DEBUG"), pytest.raises(RuntimeError, match="broadcast") as info:
        run_once(loss_fn)
    assert any(str(frame.path) == THIS_FILE and "torch.ones(3, 5)" in str(frame.statement) for frame in info.traceback)
    assert not [r for r in caplog.records if "attempting to run meta" in r.getMessage()]
    assert not logging.getLogger("torch._subclasses.fake_tensor").filters  # removed after the trace


def test_one_hot_without_num_classes_names_the_line():
    """torch reads ``labels.max()`` for the width (docs/compiling.md's purity table)."""

    def loss_fn(params, batch):
        return (forward(params, batch) * torch.nn.functional.one_hot(batch["y"].long().abs() % 4)).mean()  # width?

    with pytest.raises(fsg.HostSyncError) as info:
        run_once(loss_fn)
    assert "# width?" in str(info.value) and THIS_FILE in str(info.value)
