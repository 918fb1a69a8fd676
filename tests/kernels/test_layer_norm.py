"""LayerNorm kernels under Triton's CPU interpreter, against the eager reference.

float32 only on CPU (the interpreter is wrong for bf16); tolerance 1e-5 relative.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src.kernels import layer_norm as K
from fsg._src.kernels._common import RowTiling
from tests.kernels.common import KERNEL, needs_triton, rel

pytestmark = needs_triton


@KERNEL
@given(st.integers(1, 40), st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_forward_writes_every_element_and_matches_the_reference(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, n, generator=g) * 3 + 1, torch.randn(n, generator=g), torch.randn(n, generator=g)
    y, mean, rstd = (torch.full(s, float("nan")) for s in ((m, n), (m,), (m,)))  # poisoned
    K.launch_fwd(x, w, b, y, mean, rstd, 1e-5)
    y_ref, mean_ref, rstd_ref = K.layer_norm_reference(x, w, b, 1e-5)
    assert not (y.isnan().any() or mean.isnan().any() or rstd.isnan().any())
    assert rel(y, y_ref) < 1e-5 and rel(mean, mean_ref) < 1e-5 and rel(rstd, rstd_ref) < 1e-5


@KERNEL
@given(st.integers(1, 40), st.integers(1, 300), st.sampled_from([None, 1, 3]), st.integers(0, 2**31 - 1))
def test_backward_writes_every_element_and_matches_the_reference(m, n, iters, seed):
    """Row tiles and iterations that do not divide M leave partly masked tiles."""
    g = torch.Generator().manual_seed(seed)
    x, w, dy = torch.randn(m, n, generator=g), torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    _, mean, rstd = K.layer_norm_reference(x, w, torch.zeros(n), 1e-5)
    tiling = RowTiling(m, n, backward=True, iters=iters)
    dx = torch.full((m, n), float("nan"))
    dw_part, db_part = (torch.full((tiling.programs, n), float("nan")) for _ in range(2))
    K.launch_bwd(dy, x, w, mean, rstd, dx, dw_part, db_part, tiling)
    dx_ref, dw_ref, db_ref = K.layer_norm_backward_reference(dy, x, w, mean, rstd)
    assert not (dx.isnan().any() or dw_part.isnan().any() or db_part.isnan().any())
    assert rel(dx, dx_ref) < 1e-5 and rel(dw_part.sum(0), dw_ref) < 1e-5 and rel(db_part.sum(0), db_ref) < 1e-5


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_op_under_autograd_matches_torch_layer_norm(with_bias):
    x = torch.randn(5, 123, requires_grad=True)
    w = torch.randn(123, requires_grad=True)
    b = torch.randn(123, requires_grad=True) if with_bias else None
    y = fsg.nn.layer_norm(x, w, b, eps=1e-5)
    (y * torch.arange(123.0)).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if with_bias else None
    y2 = torch.nn.functional.layer_norm(x2, (123,), w2, b2, eps=1e-5)
    (y2 * torch.arange(123.0)).sum().backward()
    assert rel(y, y2) < 1e-5 and rel(x.grad, x2.grad) < 1e-5 and rel(w.grad, w2.grad) < 1e-5
    if with_bias:
        assert rel(b.grad, b2.grad) < 1e-5
