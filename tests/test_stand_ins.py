"""torch code a trace cannot run as written, traced as fsg's stand-ins
(``fsg/_src/trace/stand_ins.py``): ``BatchNorm(momentum=None)``'s cumulative average,
``SyncBatchNorm`` (a BatchNorm of the global step) and ``F.gaussian_nll_loss``'s check for
negative variances. Each equals torch's on every input torch accepts; a negative variance makes
the loss NaN where torch raises."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsg
from fsg._src.trace import stand_ins
from tests.helpers import DEVICES

BATCH_NORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class _Net(nn.Module):
    """A convolution (or linear layer) into a BatchNorm with ``momentum=None`` and a head."""

    def __init__(self, dims, channels, affine):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
        self.proj = nn.Linear(3, channels) if dims == 0 else conv[dims](3, channels, 1)
        self.norm = BATCH_NORMS[max(dims, 1)](channels, momentum=None, affine=affine)
        self.head = nn.Linear(channels, 1)

    def forward(self, x):
        y = torch.tanh(self.norm(self.proj(x)))
        return self.head(y.flatten(2).mean(-1) if y.dim() > 2 else y)


def _shape(dims, rows):
    return (rows, 3) if dims == 0 else (rows, 3, *[3] * dims)


@settings(max_examples=8, deadline=None)
@given(dims=st.integers(0, 3), channels=st.integers(1, 5), affine=st.booleans(), rows=st.integers(2, 6),
       steps=st.integers(1, 3), seed=st.integers(0, 99))  # fmt: skip
def test_a_cumulative_batch_norm_steps_as_eager_pytorch(dims, channels, affine, rows, steps, seed):
    """Loss, params, running statistics and the batch count equal eager SGD's after each step;
    an evaluation step then normalizes by the cumulative statistics as eager eval does."""
    torch.manual_seed(seed)
    model = _Net(dims, channels, affine)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def loss_fn(params, batch, buffers):
        return ((fsg.apply(model, params, batch["x"], buffers=buffers) - batch["y"]) ** 2).mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = {"x": torch.randn(_shape(dims, rows), generator=g) * 2 + 1, "y": torch.randn(rows, 1, generator=g)}
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = ((ref(batch["x"]) - batch["y"]) ** 2).mean()
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(state.buffers[name], b, rtol=1e-5, atol=1e-6, msg=name)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert int(state.buffers["norm.num_batches_tracked"]) == steps
    ev = fsg.compile_eval(lambda p, b, bufs: fsg.apply(model, p, b["x"], buffers=bufs), backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(ev(state, batch), ref.eval()(batch["x"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_cumulative_batch_norm_under_inductor_and_in_a_subclass(device):
    """Inductor's step equals eager; a subclass whose forward calls ``super().forward`` traces
    too; after the trace the classes are torch's own again."""

    class Scaled(nn.BatchNorm1d):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Scaled(6, momentum=None), nn.ReLU(), nn.Linear(6, 1)).to(device)
    ref = copy.deepcopy(model)
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(device) for seed in range(3)]
    _steps_as_eager_sgd(model, ref, xs, "inductor")
    assert all("forward" not in cls.__dict__ for cls in BATCH_NORMS.values())
    assert nn.BatchNorm2d.forward is stand_ins._FORWARD and F.gaussian_nll_loss is stand_ins._GAUSSIAN_NLL


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_sync_batch_norm_steps_as_the_batch_norm_it_is(momentum):
    """``convert_sync_batchnorm`` (torchvision's ``--sync-bn``) on one process: eager's
    SyncBatchNorm is then a BatchNorm, and so is the traced one (on a mesh, too:
    tests/dist/test_sharding.py)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1))
    plain(torch.randn(2, 3, 6, 6))  # materialize the lazy head
    model = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
    assert isinstance(model[1], nn.SyncBatchNorm)
    xs = [torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    _steps_as_eager_sgd(model, plain, xs, "aot_eager")
    assert "forward" in nn.SyncBatchNorm.__dict__ and nn.SyncBatchNorm.forward.__module__ == "torch.nn.modules.batchnorm"


def _steps_as_eager_sgd(model, ref, xs, backend):
    """SGD steps of ``mean(model(x)**2)`` compiled with ``backend`` leave the params and
    buffers of eager SGD on ``ref``."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = fsg.compile_step(lambda p, b, bufs: fsg.apply(model, p, b, buffers=bufs).square().mean(),
                            optimizer=fsg.optim.sgd(0.1), backend=backend)  # fmt: skip
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    for x in xs:
        state, _ = step(state, x)
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    for name, b in ref.named_buffers():
        torch.testing.assert_close(state.buffers[name], b, rtol=1e-5, atol=1e-6, msg=name)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _variance_shapes(draw_shape):
    """(input shape, var shape) pairs of every kind torch takes: heteroscedastic, one
    variance per row (one dimension short), and broadcast along one dimension."""
    shape = list(draw_shape)
    yield "same", tuple(shape)
    yield "one short", tuple(shape[:-1])
    for d in range(len(shape)):
        if shape[d] > 1:
            yield f"broadcast dim {d}", tuple(1 if i == d else s for i, s in enumerate(shape))


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), full=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-2, 0.5]), reduction=st.sampled_from(["mean", "sum", "none"]),
       seed=st.integers(0, 99))  # fmt: skip
def test_the_gaussian_nll_stand_in_equals_torch_with_gradients(shape, full, eps, reduction, seed):
    g = torch.Generator().manual_seed(seed)
    for kind, var_shape in _variance_shapes(shape):
        x, t = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
        v = torch.rand(var_shape, generator=g, dtype=torch.float64) * 2  # some below eps: clamped alike
        got_in, want_in = (x.clone().requires_grad_(), v.clone().requires_grad_()), (x.clone().requires_grad_(),
                                                                                       v.clone().requires_grad_())  # fmt: skip
        got = stand_ins.gaussian_nll_loss(got_in[0], t, got_in[1], full=full, eps=eps, reduction=reduction)
        want = F.gaussian_nll_loss(want_in[0], t, want_in[1], full=full, eps=eps, reduction=reduction)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=kind)
        got.sum().backward()
        want.sum().backward()
        for a, b in zip(got_in, want_in):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=kind)


def test_the_gaussian_nll_stand_in_refuses_what_torch_refuses():
    x = torch.randn(4, 3)
    for var, reduction in ((torch.ones(2, 2), "mean"), (torch.ones(4, 3), "average")):
        with pytest.raises(ValueError) as want:
            F.gaussian_nll_loss(x, x, var, reduction=reduction)
        with pytest.raises(ValueError, match=str(want.value)):
            stand_ins.gaussian_nll_loss(x, x, var, reduction=reduction)
    with pytest.raises(ValueError, match="negative"):
        stand_ins.gaussian_nll_loss(x, x, -1.0)  # a float: checked in Python, as torch does
    assert torch.isnan(stand_ins.gaussian_nll_loss(x, x, torch.tensor([1.0, -1.0, 1.0]).expand(4, 3)))


def test_gaussian_nll_in_a_step_a_negative_variance_is_a_nonfinite_step():
    """``nn.GaussianNLLLoss`` with a predicted variance steps as eager; a variance with a
    negative entry (torch raises) gives a NaN loss, which ``skip_nonfinite`` skips."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 6)
    criterion = nn.GaussianNLLLoss()

    def loss_fn(params, batch):
        out = fsg.apply(layer, params, batch["x"])
        return criterion(out[:, :3], batch["y"], out[:, 3:] * batch["sign"])

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager", skip_nonfinite=True)
    state = step.init(fsg.params(layer))
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    sign = torch.sign(layer(x)[:, 3:]).detach()  # every variance positive at the start
    state, metrics = step(state, {"x": x, "y": y, "sign": sign})
    want = criterion(layer(x)[:, :3], y, layer(x)[:, 3:] * sign)
    torch.testing.assert_close(metrics["loss"], want.detach(), rtol=1e-5, atol=1e-6)
    before = {k: v.clone() for k, v in state.params.items()}
    state, metrics = step(state, {"x": x, "y": y, "sign": -torch.ones_like(sign)})
    assert torch.isnan(metrics["loss"]) and int(metrics["skipped"]) == 1
    assert all(torch.equal(before[k], state.params[k]) for k in before)
