"""Complex parameters (a Fourier neural operator's spectral weights): trained as torch.optim
trains them, their real and imaginary parts as pairs of reals (``optim/_complex.py``)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg
from tests.dist.complex_workers import SpectralConv

F64 = fsg.Policy(param=torch.float64, compute=torch.float64)
optim = fsg.optim
OPTIMIZERS = {
    "sgd(momentum, nesterov)": (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
                                lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True)),
    "adam": (lambda: optim.adam(1e-2), lambda p: torch.optim.Adam(p, 1e-2)),
    "adamw": (lambda: optim.adamw(1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, 1e-2, weight_decay=0.1)),
    "rmsprop": (lambda: optim.rmsprop(1e-2), lambda p: torch.optim.RMSprop(p, 1e-2)),
    "adagrad": (lambda: optim.adagrad(1e-1), lambda p: torch.optim.Adagrad(p, 1e-1)),
    "adam(amsgrad, l2)": (lambda: optim.adam(1e-2, weight_decay=0.1, amsgrad=True),
                          lambda p: torch.optim.Adam(p, 1e-2, weight_decay=0.1, amsgrad=True)),
    "nadam": (lambda: optim.nadam(1e-2), lambda p: torch.optim.NAdam(p, 1e-2)),
    "radam": (lambda: optim.radam(1e-2), lambda p: torch.optim.RAdam(p, 1e-2)),
    "adamax": (lambda: optim.adamax(1e-2), lambda p: torch.optim.Adamax(p, 1e-2)),
    "adadelta": (lambda: optim.adadelta(), lambda p: torch.optim.Adadelta(p)),
}  # fmt: skip


def _model(channels, modes, length, dtype=torch.complex128):
    torch.manual_seed(0)
    model = SpectralConv(channels, modes, length)
    # the head alone: module.to(dtype) would drop the complex weight's imaginary parts
    model.head.to(torch.float64 if dtype == torch.complex128 else torch.float32)
    model.weight.data = model.weight.data.to(dtype)
    return model


def _batches(channels, length, dtype=torch.float64, n=3):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(6, channels, length, generator=g, dtype=dtype),
             "y": torch.randn(6, length, generator=g, dtype=dtype)} for _ in range(n)]  # fmt: skip


def _loss_of(model):
    return lambda params, batch: ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()


@pytest.mark.parametrize("name", OPTIMIZERS)
@settings(max_examples=3, deadline=None)
@given(channels=st.integers(1, 5), modes=st.integers(1, 5), clip=st.sampled_from([None, 0.05]))
def test_complex_params_train_as_torch_optim_trains_them(name, channels, modes, clip):
    make, make_torch = OPTIMIZERS[name]
    model, length = _model(channels, modes, 8), 8
    ref = copy.deepcopy(model)
    ref_opt = make_torch(ref.parameters())
    opt = make() if clip is None else optim.chain(optim.clip_by_global_norm(clip), make())
    step = fsg.compile_step(_loss_of(model), optimizer=opt, backend="aot_eager", precision=F64)
    state = step.init(fsg.params(model))
    for batch in _batches(channels, length):
        state, metrics = step(state, batch)
        ref_opt.zero_grad()
        loss = _loss_of(ref)(dict(ref.named_parameters()), batch)
        loss.backward()
        norm = torch.sqrt(sum((p.grad.abs() ** 2).sum() for p in ref.parameters()))  # over |g|, as torch's norms
        if clip is not None and norm > clip:  # optax's clip (torch's clip_grad_norm_ divides by norm + 1e-6)
            for p in ref.parameters():
                p.grad.mul_(clip / norm)
        ref_opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-12, atol=1e-12)  # float64, as the loss
        torch.testing.assert_close(metrics["grad_norm"].double(), norm, rtol=1e-6, atol=0)
    assert state.params["weight"].dtype == torch.complex128
    for name_, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name_], p.detach(), rtol=1e-10, atol=1e-12)


def test_complex_params_under_inductor_and_a_float32_policy():
    """``Policy(param=torch.float32)`` makes a complex128 weight complex64 (as float64 weights
    become float32); Inductor's step equals eager AdamW's in float32."""
    model = _model(3, 4, 8)
    ref = copy.deepcopy(model)
    ref.head.float()
    ref.weight.data = ref.weight.data.to(torch.complex64)
    ref_opt = torch.optim.AdamW(ref.parameters(), 1e-2, weight_decay=0.1)
    step = fsg.compile_step(_loss_of(model), optimizer=optim.adamw(1e-2, weight_decay=0.1), backend="inductor",
                            precision=fsg.Policy(param=torch.float32))  # fmt: skip
    state = step.init(fsg.params(model))
    assert state.params["weight"].dtype == torch.complex64
    assert state.opt_state[0].mu["weight"].shape == (3, 3, 4, 2)  # the real view's moments, as torch.optim's
    for batch in _batches(3, 8, torch.float32):
        state, _ = step(state, batch)
        ref_opt.zero_grad()
        _loss_of(ref)(dict(ref.named_parameters()), batch).backward()
        ref_opt.step()
    torch.testing.assert_close(state.params["weight"], ref.weight.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name, make", [("adafactor", lambda: optim.adafactor(1e-2)), ("muon", lambda: optim.muon(0.02))]
)
def test_optimizers_without_complex_math_refuse_a_complex_param(name, make):
    model = _model(2, 3, 8)
    step = fsg.compile_step(_loss_of(model), optimizer=make(), backend="aot_eager")
    with pytest.raises(fsg.ArgumentError, match=rf"{name}: params\['weight'\] is complex.*multi_transform"):
        step.init({"weight": fsg.params(model)["weight"]})


def test_a_complex_state_checkpoints_and_exports(tmp_path):
    model = _model(2, 3, 8, torch.complex64)
    step = fsg.compile_step(_loss_of(model), optimizer=optim.adam(1e-2), backend="aot_eager")
    state, _ = step(step.init(fsg.params(model)), _batches(2, 8, torch.float32)[0])
    fsg.checkpoint.save(tmp_path / "ckpt", state)
    restored = fsg.checkpoint.restore(tmp_path / "ckpt", like=step.init(fsg.params(model)))
    assert torch.equal(restored.params["weight"], state.params["weight"])
    assert torch.equal(restored.opt_state[0].nu["weight"], state.opt_state[0].nu["weight"])
    safetensors = pytest.importorskip("safetensors.torch")
    fsg.checkpoint.export_safetensors(tmp_path / "w.safetensors", state.params)
    assert torch.equal(safetensors.load_file(tmp_path / "w.safetensors")["weight"], state.params["weight"])



class _Filtered(torch.nn.Module):
    """Complex weights through a fixed complex window (a buffer) on the lowest 4 modes."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(3, 3, 4, dtype=dtype) / 3)
        self.register_buffer("window", torch.linspace(0.5, 1.5, 4, dtype=dtype) * (1 + 0.5j))
        self.register_buffer("other", torch.ones(4, dtype=torch.complex32))  # another dtype: kept

    def forward(self, x):
        mixed = torch.einsum("bix,iox->box", torch.fft.rfft(x)[..., :4], self.weight * self.window)
        return torch.fft.irfft(mixed, n=8).sum(1)


@pytest.mark.parametrize("model_dtype, param, want", [
    (torch.complex128, torch.float32, torch.complex64), (torch.complex64, torch.float64, torch.complex128),
    (torch.complex64, torch.float32, torch.complex64)])  # fmt: skip
def test_a_complex_buffer_follows_its_complex_params_to_the_policy_precision(model_dtype, param, want):
    """A complex buffer of the complex params' dtype goes where ``step.init`` casts them, as
    a real buffer follows real params; a buffer of another dtype stays. The steps equal eager
    Adam on the module moved to that precision by hand."""
    model = _Filtered(model_dtype)
    ref = copy.deepcopy(model)
    ref.weight.data, ref.window = ref.weight.data.to(want), ref.window.to(want)
    ref_opt = torch.optim.Adam(ref.parameters(), 1e-2)
    def loss_fn(params, batch, buffers):
        return ((fsg.apply(model, params, batch["x"], buffers=buffers) - batch["y"]) ** 2).mean()

    step = fsg.compile_step(loss_fn, optimizer=optim.adam(1e-2), backend="aot_eager",
                            precision=fsg.Policy(param=param, compute=param))  # fmt: skip
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    assert state.params["weight"].dtype == want and state.buffers["window"].dtype == want
    assert state.buffers["other"].dtype == torch.complex32 and model.window.dtype == model_dtype
    for batch in _batches(3, 8, param):
        state, _ = step(state, batch)
        ref_opt.zero_grad()
        ((ref(batch["x"]) - batch["y"]) ** 2).mean().backward()
        ref_opt.step()
    torch.testing.assert_close(state.params["weight"], ref.weight.detach(), rtol=1e-5, atol=1e-6)
