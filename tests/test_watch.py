"""A step follows its modules' flags as eager PyTorch does: ``model.train()`` / ``model.eval()``
(on the model or any submodule) and ``requires_grad_()`` between calls trace the step again,
and switching back reuses the graph already built (``fsg/_src/watch.py``)."""

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg

CHANGES = ["model.train", "model.eval", "bn.eval", "bn.train", "freeze", "unfreeze", "none"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _apply(change, model):
    if change == "model.train":
        model.train()
    elif change == "model.eval":
        model.eval()
    elif change in ("bn.eval", "bn.train"):
        model[1].train(change == "bn.train")
    elif change in ("freeze", "unfreeze"):
        model[0].weight.requires_grad_(change == "unfreeze")


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from(CHANGES), min_size=2, max_size=6), st.sampled_from(["eager", "inductor"]))
def test_mode_and_requires_grad_changes_between_steps_train_as_eager_pytorch(changes, backend):
    """Any sequence of train/eval switches (whole model, or its BatchNorm alone) and of
    freezing and unfreezing a weight between steps: losses, parameters and BatchNorm's
    running statistics equal eager PyTorch's with torch.optim.SGD (momentum) at every step."""
    model = _model()
    reference = copy.deepcopy(model)
    step = fsg.compile_step(
        lambda p, b, buf: ((fsg.apply(model, p, b["x"], buffers=buf) - b["y"]) ** 2).mean(),
        optimizer=fsg.optim.sgd(0.1, momentum=0.9),
        backend=backend,
    )
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    seen = set()
    for i, change in enumerate(changes):
        _apply(change, model)
        _apply(change, reference)
        seen.add((tuple(m.training for m in model.modules()), model[0].weight.requires_grad))
        batch = {"x": torch.randn(16, 6, generator=g), "y": torch.randn(16, 2, generator=g)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fsg.RecompileWarning)
            state, metrics = step(state, batch)
        opt.zero_grad()
        loss = ((reference(batch["x"]) - batch["y"]) ** 2).mean()
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}: {change}")
    for name, value in reference.named_parameters():
        torch.testing.assert_close(state.params[name], value.detach(), rtol=1e-4, atol=1e-5, msg=name)
    for name, value in reference.named_buffers():
        torch.testing.assert_close(state.buffers[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert step.num_compiles == len(seen)  # one trace per setting seen, not per switch


def test_dropout_follows_model_train_and_eval():
    """A step first traced in eval mode drops out after ``model.train()`` (it used not to: the
    mode was read once), and is deterministic again after ``model.eval()``, without a trace."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)).eval()
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b).pow(2).mean(), optimizer=fsg.optim.sgd(0.0),
                            backend="eager")  # fmt: skip
    state = step.init(fsg.params(model))
    x = torch.randn(32, 8)
    with torch.no_grad():
        plain = model(x).pow(2).mean()
    state, evaluated = step(state, x)
    torch.testing.assert_close(evaluated["loss"], plain)
    model.train()
    with pytest.warns(fsg.RecompileWarning, match=r"Sequential\.training: False -> True"):
        state, dropped = step(state, x)
    assert not torch.allclose(dropped["loss"], plain)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switching back reuses the eval graph: no warning
        state, again = step(state, x)
    torch.testing.assert_close(again["loss"], plain)
    assert step.num_compiles == 2


def test_strict_step_refuses_a_mode_change_by_name():
    model = _model()
    step = fsg.compile_step(lambda p, b, buf: fsg.apply(model, p, b, buffers=buf).sum(),
                            optimizer=fsg.optim.sgd(0.1), backend="eager", strict=True)  # fmt: skip
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    state, _ = step(state, torch.randn(4, 6))
    model[0].weight.requires_grad_(False)
    with pytest.raises(fsg.RecompileError, match=r"Sequential\.0\.weight\.requires_grad: True -> False.*strict=True"):
        step(state, torch.randn(4, 6))


def test_a_model_the_loss_does_not_apply_is_not_watched():
    """Only modules ``fsg.apply`` ran while the step was traced count: changing another
    module's mode does not trace again."""
    model, other = _model(), _model()
    step = fsg.compile_step(lambda p, b, buf: fsg.apply(model, p, b, buffers=buf).sum(),
                            optimizer=fsg.optim.sgd(0.1), backend="eager", strict=True)  # fmt: skip
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    state, _ = step(state, torch.randn(4, 6))
    other.eval()
    state, _ = step(state, torch.randn(4, 6))
    assert step.num_compiles == 1
