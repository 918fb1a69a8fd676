"""fsg.apply's errors (issue 21): params that do not match the module's names, and a module
that cannot be traced, named by its path in the model and the user's line."""

import numpy as np
import pytest
import torch
from torch import nn

import fsg


class _Item(nn.Module):
    def forward(self, x):
        scale = x.abs().max().item()  # _Item's line
        return x / scale


class _Branch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # _Branch's line
            return x
        return -x


class _Numpy(nn.Module):
    def forward(self, x):
        return torch.as_tensor(np.tanh(x.detach().numpy()))  # _Numpy's line


class _Net(nn.Module):
    def __init__(self, bad: nn.Module):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), bad))

    def forward(self, x):
        return self.blocks(self.stem(x))


@pytest.mark.parametrize("bad, what", [(_Item, "host"), (_Branch, "control flow"), (_Numpy, "numpy")])
def test_a_module_that_does_not_trace_is_named_with_its_path_and_line(bad, what):
    model = _Net(bad())

    def loss_fn(params, batch):
        return fsg.apply(model, params, batch).square().mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager")
    state = step.init(fsg.params(model))
    with pytest.raises(fsg.HostSyncError) as info:
        step(state, torch.randn(8, 4))
    message = str(info.value)
    assert f"'blocks.1.1' ({bad.__name__}) of the _Net" in message
    assert "test_apply_errors.py" in message and f"# {bad.__name__}'s line" in message
    assert info.value.__traceback__ is not None
    if what == "numpy":
        assert "numpy" in message
    eager = fsg.apply(model, fsg.params(model), torch.randn(8, 4))  # eagerly it runs as it did
    assert eager.shape == (8, 4)


def test_an_error_in_the_model_itself_names_the_model():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x):
            return self.lin(x) * (1.0 if x.mean() > 0 else 2.0)

    model = Root()
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b).mean(), optimizer=fsg.optim.sgd(0.1), backend="eager")
    with pytest.raises(fsg.HostSyncError, match="the Root given to fsg.apply"):
        step(step.init(fsg.params(model)), torch.randn(8, 4))


def test_a_missing_parameter_is_named():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    params = fsg.params(model)
    del params["1.bias"], params["0.weight"]
    with pytest.raises(
        fsg.StructureMismatchError, match=r"no entry for 2 parameter\(s\) of the Sequential: '0.weight', '1.bias'"
    ):
        fsg.apply(model, params, torch.ones(1, 2))


def test_an_unknown_parameter_or_buffer_is_named():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    params = {**fsg.params(model), "0.scale": torch.ones(())}
    with pytest.raises(fsg.StructureMismatchError, match=r"params names '0.scale', which the Sequential does not have"):
        fsg.apply(model, params, torch.ones(2, 2))
    with pytest.raises(fsg.StructureMismatchError, match=r"names 'x.y.z'"):
        fsg.apply(model, {**fsg.params(model), "x.y.z": torch.ones(())}, torch.ones(2, 2))
    with pytest.raises(fsg.StructureMismatchError, match=r"buffers names '1.running_std'"):
        fsg.apply(model, fsg.params(model), torch.ones(2, 2), buffers={"1.running_std": torch.ones(3)})


def test_a_tied_weight_may_be_given_under_either_name():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, idx):
            return self.head(self.embed(idx))

    model, idx = Tied(), torch.tensor([0, 4])
    w = torch.randn(5, 3)
    expected = w[idx] @ w.T
    torch.testing.assert_close(fsg.apply(model, {"embed.weight": w}, idx), expected)
    torch.testing.assert_close(fsg.apply(model, {"head.weight": w}, idx), expected)


def test_an_fsg_error_raised_inside_a_module_names_the_module():
    class Shuffle(nn.Module):
        def forward(self, x):
            return x * torch.poisson(x.abs(), generator=torch.Generator())

    model = nn.Sequential(nn.Linear(4, 4), Shuffle())
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b).mean(), optimizer=fsg.optim.sgd(0.1), backend="eager")
    with pytest.raises(fsg.UnsupportedError, match=r"poisson.*\(in module '1' \(Shuffle\) of the Sequential"):
        step(step.init(fsg.params(model)), torch.randn(8, 4))
