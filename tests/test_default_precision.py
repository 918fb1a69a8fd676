"""The default ``fsg.Policy()``: a model trains in its own precision, at least float32.

A float64 model (``model.double()``, scientific code) trains in float64 as in eager PyTorch,
equal to ``torch.optim`` to float64's precision, buffers and loss included; a bfloat16 or
float16 model gets float32 master weights; a float32 batch leaf meets a float64 model in
float64 and a float64 batch leaf a float32 model in float32 (as before)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fsg

WIDER = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32,
         torch.float16: torch.float32}  # fmt: skip


def _model(dtype, norm, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(5, 8), nn.BatchNorm1d(8) if norm else nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers).to(dtype).train()


def _loss_of(model):
    def loss(params, batch, buffers=None):
        return F.cross_entropy(fsg.apply(model, params, batch["x"], buffers=buffers), batch["y"])

    return loss


def _batches(n, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(6, 5, generator=g, dtype=dtype), "y": torch.randint(0, 3, (6,), generator=g)} for _ in range(n)]


def _step(model, **options):
    buffers = fsg.buffers(model) or None
    loss = _loss_of(model)
    fn = loss if buffers else (lambda params, batch: loss(params, batch))
    step = fsg.compile_step(fn, optimizer=fsg.optim.sgd(0.05, momentum=0.9), backend="aot_eager", **options)
    return step, step.init(fsg.params(model), buffers=buffers)


@given(dtype=st.sampled_from(list(WIDER)), norm=st.booleans(), batch_dtype=st.sampled_from([torch.float32, torch.float64]))
def test_the_state_keeps_the_models_precision_at_least_float32(dtype, norm, batch_dtype):
    model = _model(dtype, norm)
    step, state = _step(model)
    wide = WIDER[dtype]
    assert {p.dtype for p in state.params.values()} == {wide}
    assert {m.dtype for m in state.opt_state[0].trace.values()} == {wide}
    if norm:  # the running statistics follow the weights; the count stays int64
        assert state.buffers["1.running_mean"].dtype == wide and state.buffers["1.num_batches_tracked"].dtype == torch.int64
    state, metrics = step(state, _batches(1, batch_dtype)[0])  # the batch is read in the state's precision
    assert metrics["loss"].dtype == wide and torch.isfinite(metrics["loss"])
    assert {p.dtype for p in state.params.values()} == {wide}


@pytest.mark.parametrize("norm", [True, False])
def test_a_float64_model_trains_as_torch_optim_does_in_float64(norm):
    model = _model(torch.float64, norm)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    step, state = _step(model)
    for batch in _batches(4, torch.float64):
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = F.cross_entropy(ref(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-13, atol=1e-13)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-12, atol=1e-13, msg=name)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(state.buffers[name], b, rtol=1e-12, atol=1e-13, msg=name)
    metrics = fsg.compile_eval(lambda p, b, *bu: {"loss": _loss_of(model)(p, b, *bu)}, backend="aot_eager")(state, batch)
    with torch.no_grad():
        expected = F.cross_entropy(ref.eval()(batch["x"]), batch["y"])
    torch.testing.assert_close(metrics["loss"], expected, rtol=1e-13, atol=1e-13)


def test_one_float64_parameter_makes_the_whole_state_float64():
    model = _model(torch.float32, norm=False)
    model[3].double()  # a float64 head on float32 features
    _, state = _step(model)
    assert {p.dtype for p in state.params.values()} == {torch.float64}


def test_an_explicit_param_dtype_still_casts():
    model = _model(torch.float64, norm=True)
    step, state = _step(model, precision=fsg.Policy(param=torch.float32))
    assert {p.dtype for p in state.params.values()} == {torch.float32}
    assert state.buffers["1.running_var"].dtype == torch.float32
    _, metrics = step(state, _batches(1, torch.float64)[0])
    assert metrics["loss"].dtype == torch.float32


def test_resolve_fills_in_only_what_was_left_out():
    f64 = {"w": torch.zeros(2, dtype=torch.float64)}
    assert fsg.Policy().resolve(f64)[:2] == (torch.float64, torch.float64)
    assert fsg.Policy().resolve({"w": torch.zeros(2, dtype=torch.bfloat16)})[:2] == (torch.float32, torch.float32)
    assert fsg.Policy().resolve({"w": torch.zeros(2, dtype=torch.complex128)})[:2] == (torch.float64, torch.float64)
    assert fsg.Policy(compute=torch.bfloat16).resolve(f64)[:2] == (torch.float64, torch.bfloat16)
    assert fsg.Policy(param=torch.float32).resolve(f64)[:2] == (torch.float32, torch.float32)


def _pinn_residual(model_fn, x):
    """A physics-informed loss: u'' = -sin(x) in the input, through autograd inside the loss."""
    x = x.clone().requires_grad_(True)
    du = torch.autograd.grad(model_fn(x).sum(), x, create_graph=True)[0]
    d2u = torch.autograd.grad(du.sum(), x, create_graph=True)[0]
    return ((d2u + torch.sin(x)) ** 2).mean() + (model_fn(torch.zeros(1, 1, dtype=x.dtype)) ** 2).mean()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_float64_physics_informed_loss_trains_as_eager(backend):
    """Scientific code's float64 case: second derivatives in the input (double backward inside
    the traced loss), 3 Adam steps equal to torch.optim.Adam to float64's precision."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    ref = copy.deepcopy(model)
    step = fsg.compile_step(lambda p, b: _pinn_residual(lambda x: fsg.apply(model, p, x), b["x"]),
                            optimizer=fsg.optim.adam(1e-3), backend=backend)  # fmt: skip
    state = step.init(fsg.params(model))
    opt = torch.optim.Adam(ref.parameters(), 1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = {"x": torch.rand(32, 1, generator=g, dtype=torch.float64) * 3}
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = _pinn_residual(ref, batch["x"])
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-12, atol=1e-14)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-10, atol=1e-13, msg=name)
