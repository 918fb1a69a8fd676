"""RMSNorm kernels under Triton's CPU interpreter, against the eager reference.

float32 only: the interpreter is wrong for bf16 (DESIGN §5); tests/gpu covers bf16 on CUDA.
Tolerance: float32, 1e-5 relative (one reduction per row in a different order).
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from fsg._src.kernels import rms_norm as K
from fsg._src.kernels._common import RowTiling
from tests.kernels.common import KERNEL, needs_triton, rel

pytestmark = needs_triton


@KERNEL
@given(st.integers(1, 40), st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_forward_writes_every_element_and_matches_the_reference(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, n, generator=g), torch.randn(n, generator=g)
    y = torch.full((m, n), float("nan"))  # poisoned: an unwritten element stays NaN
    rstd = torch.full((m,), float("nan"))
    K.launch_fwd(x, w, y, rstd, 1e-6)
    y_ref, rstd_ref = K.rms_norm_reference(x, w, 1e-6)
    assert not y.isnan().any() and not rstd.isnan().any()
    assert rel(y, y_ref) < 1e-5 and rel(rstd, rstd_ref) < 1e-5


@KERNEL
@given(st.integers(1, 40), st.integers(1, 300), st.sampled_from([None, 1, 3]), st.integers(0, 2**31 - 1))
def test_backward_writes_every_element_and_matches_the_reference(m, n, iters, seed):
    """Row tiles and iterations that do not divide M leave partly masked tiles."""
    g = torch.Generator().manual_seed(seed)
    x, w, dy = torch.randn(m, n, generator=g), torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    _, rstd = K.rms_norm_reference(x, w, 1e-6)
    tiling = RowTiling(m, n, backward=True, iters=iters)
    dx = torch.full((m, n), float("nan"))
    dw_part = torch.full((tiling.programs, n), float("nan"))
    K.launch_bwd(dy, x, w, rstd, dx, dw_part, tiling)
    dx_ref, dw_ref = K.rms_norm_backward_reference(dy, x, w, rstd)
    assert not dx.isnan().any() and not dw_part.isnan().any()
    assert rel(dx, dx_ref) < 1e-5 and rel(dw_part.sum(0), dw_ref) < 1e-5


def test_the_op_under_autograd_matches_torch_rms_norm():
    x = torch.randn(5, 123, requires_grad=True)
    w = torch.randn(123, requires_grad=True)
    y = K.rms_norm(x, w, eps=1e-5)
    (y * torch.arange(123.0)).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = torch.nn.functional.rms_norm(x2, (123,), w2, eps=1e-5)
    (y2 * torch.arange(123.0)).sum().backward()
    assert rel(y, y2) < 1e-5 and rel(x.grad, x2.grad) < 1e-5 and rel(w.grad, w2.grad) < 1e-5


def test_a_traced_step_holds_the_fused_nodes():
    import fsg

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)

    def loss_fn(params, batch):
        h = fsg.nn.rms_norm(batch["x"], params["norm"])
        return ((fsg.apply(model, {k: v for k, v in params.items() if k != "norm"}, h) - batch["y"]) ** 2).mean()

    params = {**fsg.params(model), "norm": torch.ones(16)}
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(1e-2), backend="aot_eager")
    state = step.init(params)
    batch = {"x": torch.randn(5, 16), "y": torch.randn(5, 16)}
    text = step.lower(state, batch).as_text()
    assert text.count("torch.ops.fsg.rms_norm_fwd.default") == 1
    assert text.count("torch.ops.fsg.rms_norm_bwd.default") == 1
    state, metrics = step(state, batch)  # runs the kernels (interpreter on CPU)
    assert torch.isfinite(metrics["loss"]) and not torch.equal(state.params["norm"], torch.ones(16))
