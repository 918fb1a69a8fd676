"""fsg.params / fsg.buffers / fsg.apply on top of torch.func.functional_call."""

import torch
from torch import nn

import fsg


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # weight tying

    def forward(self, idx):
        return self.head(self.embed(idx))


def test_tied_weights_are_stored_once_and_retied():
    model = Tied()
    params = fsg.params(model)
    assert sorted(params) == ["embed.weight"]
    new = {"embed.weight": torch.randn(10, 4)}
    idx = torch.tensor([1, 2])
    expected = new["embed.weight"][idx] @ new["embed.weight"].T
    assert torch.allclose(fsg.apply(model, new, idx), expected)


def test_gradient_of_a_tied_weight_sums_both_uses():
    model = Tied()
    params = fsg.params(model)
    idx = torch.tensor([1, 2, 3])
    grads = torch.func.grad(lambda p: fsg.apply(model, p, idx).square().sum())(params)
    model.zero_grad()
    model(idx).square().sum().backward()
    assert torch.allclose(grads["embed.weight"], model.embed.weight.grad)


def test_params_are_detached_and_share_storage():
    model = nn.Linear(3, 2)
    params = fsg.params(model)
    assert not params["weight"].requires_grad
    assert params["weight"].data_ptr() == model.weight.data_ptr()


def test_apply_uses_given_params_not_the_module_ones():
    model = nn.Linear(3, 2)
    zeros = {k: torch.zeros_like(v) for k, v in fsg.params(model).items()}
    assert torch.equal(fsg.apply(model, zeros, torch.randn(5, 3)), torch.zeros(5, 2))


def test_buffers_and_apply_with_buffers():
    model = nn.BatchNorm1d(3).eval()
    bufs = fsg.buffers(model)
    assert sorted(bufs) == ["num_batches_tracked", "running_mean", "running_var"]
    shifted = {**bufs, "running_mean": torch.ones(3)}
    x = torch.ones(2, 3)
    out = fsg.apply(model, fsg.params(model), x, buffers=shifted)
    assert torch.allclose(out, torch.zeros(2, 3), atol=1e-6)
