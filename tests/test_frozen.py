"""Frozen parameters (``requires_grad=False``): a compiled step leaves them, and their optimizer
state, bit for bit as they were, and trains the rest as eager PyTorch does
(``fsg/_src/frozen.py``)."""

import copy
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg
from tests.helpers import steps_beside_eager


def _mlp(widths, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.Tanh()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers)


def _batches(n, d_in, d_out, rows=16):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, d_in, generator=g), "y": torch.randn(rows, d_out, generator=g)} for _ in range(n)]


def _eager_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


OPTIMIZERS = {  # fsg's and torch's same optimizer, by name
    "adamw": (lambda: fsg.optim.adamw(1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "sgd": (lambda: fsg.optim.sgd(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
}  # fmt: skip


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.integers(2, 9), min_size=3, max_size=5), st.data(), st.sampled_from(sorted(OPTIMIZERS)),
    st.sampled_from([1, 2]),
)  # fmt: skip
def test_frozen_parameters_stay_and_the_rest_train_as_eager_pytorch(widths, data, optimizer, accum_steps):
    """Any subset of an MLP's weights and biases frozen, under AdamW with weight decay or SGD
    with momentum, with or without gradient accumulation: the frozen ones and their optimizer
    state come back bit for bit; the others equal torch.optim's, which skips a parameter
    without a gradient."""
    model = _mlp(widths)
    names = [n for n, _ in model.named_parameters()]
    frozen = set(data.draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names) - 1)))
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    reference = copy.deepcopy(model)
    make_fsg, make_torch = OPTIMIZERS[optimizer]
    step = fsg.compile_step(lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean(),
                            optimizer=make_fsg(), accum_steps=accum_steps, backend="eager")  # fmt: skip
    state = step.init(fsg.params(model))
    before = copy.deepcopy(state)
    opt = make_torch([p for p in reference.parameters() if p.requires_grad])
    state = steps_beside_eager(step, state, reference, opt, _batches(3, widths[0], widths[-1]), _eager_loss)
    params = dict(reference.named_parameters())
    for name, value in state.params.items():
        if name in frozen:
            assert torch.equal(value, before.params[name]), name
        else:
            torch.testing.assert_close(value, params[name].detach(), rtol=1e-4, atol=1e-5, msg=name)
    for new, old in zip(_per_param(state.opt_state, names), _per_param(before.opt_state, names)):
        for name in frozen:
            assert torch.equal(new[name], old[name]), name


def _per_param(opt_state, names):
    """The subtrees of the optimizer state keyed like the params (moments, momentum)."""
    found = []

    def walk(node):
        if isinstance(node, dict) and sorted(node) == sorted(names):
            found.append(node)
        elif isinstance(node, (tuple, list)):
            for child in node:
                walk(child)

    walk(opt_state)
    return found


def test_frozen_parameters_are_logged_and_get_no_gradient_computation(caplog):
    """The step's graph computes no gradient for a frozen layer's weight (its matmul with the
    upstream gradient is not there), and the trace says which parameters it leaves."""
    model = _mlp([4, 8, 8, 2])
    model[2].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    step = fsg.compile_step(lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean(),
                            optimizer=fsg.optim.sgd(0.1), backend="eager")  # fmt: skip
    batch = _batches(1, 4, 2)[0]
    with caplog.at_level(logging.INFO, logger="fsg"):
        state = step.init(fsg.params(model))
        text = step.lower(state, batch).as_text()
    said = [r.getMessage() for r in caplog.records if "frozen" in r.getMessage()]
    assert len(said) == 1 and "2 frozen parameter(s) (requires_grad=False) not trained:" in said[0]
    assert "params['2.weight']" in said[0] and "params['2.bias']" in said[0]
    # three linear layers: a trained one's weight gradient is one mm; a frozen one's is not computed
    assert text.count("aten.mm.default(") < _mm_count(_mlp([4, 8, 8, 2]), batch)


def _mm_count(model, batch):
    step = fsg.compile_step(lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean(),
                            optimizer=fsg.optim.sgd(0.1), backend="eager")  # fmt: skip
    return step.lower(step.init(fsg.params(model)), batch).as_text().count("aten.mm.default(")


@pytest.mark.inductor
def test_frozen_parameters_under_inductor_and_the_fused_adamw():
    """Under Inductor (the fused AdamW pass on the update) the frozen weight stays bit for bit
    and the step equals the eager backend's."""
    model = _mlp([8, 16, 16, 4])
    model[2].weight.requires_grad_(False)
    states = []
    for backend in ("eager", "inductor"):
        step = fsg.compile_step(lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean(),
                                optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), backend=backend)  # fmt: skip
        state = step.init(fsg.params(model))
        for batch in _batches(3, 8, 4):
            state, _ = step(state, batch)
        states.append(state)
    assert torch.equal(states[1].params["2.weight"], model[2].weight.detach())
    for name, value in states[1].params.items():
        torch.testing.assert_close(value, states[0].params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_parameter_the_loss_does_not_reach_is_not_updated_as_in_eager_pytorch(caplog):
    """An unused head gets no gradient, so torch.optim skips it (``.grad`` is None): no update and
    no weight decay. The step leaves it bit for bit too, and says so; the rest trains as eager."""

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head, self.unused = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

    torch.manual_seed(0)
    model = TwoHeads()
    reference = copy.deepcopy(model)
    step = fsg.compile_step(lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean(),
                            optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), backend="eager")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="fsg"):
        state = steps_beside_eager(step, step.init(fsg.params(model)), reference,
                                   torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1),
                                   _batches(3, 4, 2), _eager_loss)  # fmt: skip
    assert "2 parameter(s) the loss does not reach not trained: params['unused.bias'], params['unused.weight']" in caplog.text
    for name, p in reference.named_parameters():
        if name.startswith("unused"):
            assert torch.equal(state.params[name], model.get_parameter(name).detach()), name
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
