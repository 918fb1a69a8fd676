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


def test_a_penalty_on_the_modules_parameters_after_fsg_apply_trains_them():
    """While a step is traced, fsg.apply leaves the step's tensors swapped into the module until
    the backward is traced (fsg/_src/recompute.py), so a penalty that reads ``model.parameters()``
    after the call sees the step's parameters and trains them, as in eager PyTorch (before, it
    read the module's initial values as constants; before the call it still would, and that is
    refused: tests/test_bad_input.py)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(model)

    def penalized(m, out):
        return (out**2).mean() + 0.1 * sum(p.square().sum() for p in m.parameters())

    step = fsg.compile_step(lambda p, b: penalized(model, fsg.apply(model, p, b["x"])), optimizer=fsg.optim.sgd(0.1),
                            backend="eager")  # fmt: skip
    state = step.init(fsg.params(model))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 4, generator=g)
        state, metrics = step(state, {"x": x})
        opt.zero_grad()
        loss = penalized(reference, reference(x))
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
