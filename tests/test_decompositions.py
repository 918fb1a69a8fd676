"""fsg's corrections of torch's decompositions equal the eager ops they stand for, and a
compiled step that uses one trains as the eager loss does (torch's own decomposition of
``multilabel_margin_loss`` did not, under ``torch.compile`` too: pytorch issue 141017)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg
from fsg._src import decompositions


@st.composite
def multilabel_cases(draw):
    batched = draw(st.booleans())
    rows, classes = (draw(st.integers(1, 5)) if batched else 1), draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(rows, classes, generator=gen, dtype=torch.float64)
    # any labels, -1 anywhere (a row's labels end at its first negative entry), repeats allowed
    target = torch.randint(-1, classes, (rows, classes), generator=gen)
    if not batched:
        x, target = x[0], target[0]
    return x, target, draw(st.sampled_from([0, 1, 2]))


@settings(max_examples=60, deadline=None)
@given(multilabel_cases())
def test_multilabel_margin_loss_forward_equals_the_eager_op(case):
    x, target, reduction = case
    want = torch.ops.aten.multilabel_margin_loss_forward(x, target, reduction)
    got = decompositions.multilabel_margin_loss_forward(x, target, reduction)
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.dtype == g.dtype
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_step_with_multilabel_margin_loss_trains_as_eager(backend):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 5, generator=gen), torch.randn(5, 5, generator=gen)
    y = torch.tensor([[2, 0, -1, -1, 3]] * 4 + [[1, -1, 0, 0, 0]] * 4)
    loss_fn = lambda p, b: F.multilabel_margin_loss(b["x"] @ p["w"], b["y"])  # noqa: E731
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.5), backend=backend, donate=False)
    state, metrics = step(step.init({"w": w}), {"x": x, "y": y})

    ref = w.clone().requires_grad_()
    loss = loss_fn({"w": ref}, {"x": x, "y": y})
    loss.backward()
    torch.testing.assert_close(metrics["loss"], loss.detach())
    torch.testing.assert_close(state.params["w"], (ref - 0.5 * ref.grad).detach())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), max_size=3), st.lists(st.integers(0, 3), max_size=2), st.integers(0, 2**16))
def test_take_equals_the_eager_op(shape, index_shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    index = torch.randint(-x.numel(), x.numel(), index_shape, generator=gen)
    got, want = decompositions.take(x, index), torch.take(x, index)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


def test_a_compiled_step_taking_by_a_0_d_index_trains_as_eager():
    """Inductor failed on it with torch's decomposition of ``take`` (``GuardOnDataDependentSymNode``)."""
    index = torch.tensor(-2)
    loss_fn = lambda p, b: (p["w"].take(index) * p["w"].sum()).exp()  # noqa: E731
    w = torch.tensor([[0.3, -0.2], [0.1, 0.4]], dtype=torch.float64)
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.5), backend="inductor", donate=False)
    state, metrics = step(step.init({"w": w}), {})

    ref = w.clone().requires_grad_()
    loss = loss_fn({"w": ref}, {})
    loss.backward()
    torch.testing.assert_close(metrics["loss"], loss.detach())
    torch.testing.assert_close(state.params["w"], (ref - 0.5 * ref.grad).detach())


@st.composite
def batch_norm_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    shape = (draw(st.integers(2, 5)), draw(st.integers(1, 4)), *([draw(st.integers(1, 3))] * draw(st.integers(0, 2))))
    channels = shape[1]
    stats = draw(st.booleans())
    return {
        "x": torch.randn(shape, generator=gen, dtype=torch.float64),
        "weight": torch.randn(channels, generator=gen, dtype=torch.float64) if draw(st.booleans()) else None,
        "bias": torch.randn(channels, generator=gen, dtype=torch.float64) if draw(st.booleans()) else None,
        "mean": torch.randn(channels, generator=gen, dtype=torch.float64) if stats else None,
        "var": torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5 if stats else None,
        "training": draw(st.booleans()) or not stats,  # eval needs running statistics
        "momentum": draw(st.sampled_from([0.1, 0.5])),
    }


@settings(max_examples=40, deadline=None)
@given(batch_norm_cases())
def test_declared_write_batch_norm_equals_the_eager_op_and_its_writes(case):
    # native_batch_norm traced as _native_batch_norm_legit (DECLARED_WRITES): the same outputs
    # and the same in-place update of the running statistics, for every variant it maps to.
    def run(fn):
        mean = None if case["mean"] is None else case["mean"].clone()
        var = None if case["var"] is None else case["var"].clone()
        out = fn(case["x"], case["weight"], case["bias"], mean, var, case["training"], case["momentum"], 1e-5)
        return out, mean, var

    (out, mean, var), (ref, ref_mean, ref_var) = (
        run(decompositions.native_batch_norm),
        run(torch.ops.aten.native_batch_norm.default),
    )
    torch.testing.assert_close(out[0], ref[0])
    if case["training"]:  # the saved statistics (eval returns empty ones of either shape)
        torch.testing.assert_close(out[1], ref[1])
        torch.testing.assert_close(out[2], ref[2])
    for got, expected in ((mean, ref_mean), (var, ref_var)):
        if expected is not None:
            torch.testing.assert_close(got, expected)
