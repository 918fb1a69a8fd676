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
