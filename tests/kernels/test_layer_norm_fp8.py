"""The layer norm + rowwise FP8 cast kernel under Triton's CPU interpreter, against the unfused
graph's ops (``aten.native_layer_norm``, then the rowwise cast of its output).

float32 inputs and a float32 buffer for the FP8 copy (the interpreter's bf16 rounding and FP8
conversion are wrong: tests/kernels/test_float8_cast.py's docstring); the FP8 bytes and the
bf16 rows are checked on the GPU (tests/gpu/test_float8_cuda.py).
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from fsg._src.kernels._common import RowTiling
from fsg._src.kernels.fp8 import cast as K
from fsg._src.kernels.fp8 import layer_norm as L
from tests.kernels.common import KERNEL, needs_triton, rel


@needs_triton
@KERNEL
@given(
    st.integers(1, 40), st.integers(1, 300), st.booleans(), st.booleans(), st.sampled_from([None, 1, 3]),
    st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_kernel_writes_every_output_and_matches_the_unfused_ops(m, n, has_w, has_b, iters, rows, seed):
    """Tiles and iterations that do not divide M leave partly masked tiles; a constant row
    normalizes to the bias (all zeros without one: a finite scale); each row's largest
    element scales to the FP8 maximum."""
    g_ = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g_) * 3 + 1
    x[0] = 2.5  # a constant row
    w = torch.randn(n, generator=g_) if has_w else None
    b = torch.randn(n, generator=g_) if has_b else None
    t = RowTiling(m, n, rows=rows, iters=iters)
    y, q = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))  # q float32: see the docstring
    mean, rstd, inv = (torch.full(shape, float("nan")) for shape in ((m,), (m,), (m, 1)))
    L.launch(x, w, b, y, mean, rstd, q, inv, 1e-5, t)
    assert not any(v.isnan().any() for v in (y, q, mean, rstd, inv))
    y_ref, mean_ref, rstd_ref, _, inv_ref = L.layer_norm_fp8_reference(x, w, b, 1e-5)
    assert (y - y_ref).abs().max() < 1e-4 * max(1.0, float(y_ref.abs().max()))
    assert rel(mean, mean_ref.reshape(m)) < 1e-5 and rel(rstd[1:], rstd_ref.reshape(m)[1:]) < 1e-4
    # the cast is of y as the kernel wrote it: its own maxima, exactly as the generic cast computes them
    _, inv_own, _, _ = K.rowwise_fp8_reference(y)
    assert rel(inv, inv_own) < 1e-6 and rel(inv, inv_ref) < 1e-3
    assert rel(q, (y / inv_own).clamp(-448, 448)) < 1e-5 and bool((q.abs() <= 448).all())
    nonzero = y.abs().amax(1) > 0
    assert torch.allclose(q.abs().amax(1)[nonzero], torch.tensor(448.0), rtol=1e-6)
    if not has_b:
        assert not y[0].any() and not q[0].any() and bool(inv[0].isfinite().all())


@needs_triton
@KERNEL
@given(
    st.integers(1, 40), st.integers(1, 200), st.booleans(), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1),
    st.sampled_from([1, 2]),
)  # fmt: skip
def test_kernel_with_a_residual_writes_the_sum_and_normalizes_it(m, n, affine, rows, seed, stages):
    """``LN(x + r)``: the sum written (the residual stream's next value) and every output as the
    unfused ops give them for that sum."""
    g_ = torch.Generator().manual_seed(seed)
    x, r = torch.randn(m, n, generator=g_) * 2, torch.randn(m, n, generator=g_) + 0.5
    w, b = (torch.randn(n, generator=g_), torch.randn(n, generator=g_)) if affine else (None, None)
    s, y, q = (torch.full((m, n), float("nan")) for _ in range(3))
    mean, rstd, inv = (torch.full(shape, float("nan")) for shape in ((m,), (m,), (m, 1)))
    L.launch(x, w, b, y, mean, rstd, q, inv, 1e-5, RowTiling(m, n, rows=rows, iters=2, stages=stages), r_MN=r, s_MN=s)
    assert torch.equal(s, x + r)
    y_ref, mean_ref, rstd_ref, _, inv_ref = L.layer_norm_fp8_reference(x + r, w, b, 1e-5)
    assert (y - y_ref).abs().max() < 1e-4 * max(1.0, float(y_ref.abs().max()))
    assert rel(mean, mean_ref.reshape(m)) < 1e-5 and rel(inv, inv_ref) < 1e-3


@needs_triton
def test_the_residual_op_on_half_precision_equals_the_add_then_the_norm():
    x, r = torch.randn(3, 5, 40, dtype=torch.float16), torch.randn(3, 5, 40, dtype=torch.float16)
    w, b = torch.randn(40, dtype=torch.float16), torch.randn(40, dtype=torch.float16)
    got = L.add_layer_norm_fp8(x, r, w, b, 1e-5)
    want = (x + r, *L.layer_norm_fp8_reference(x + r, w, b, 1e-5))
    assert torch.equal(got[0], want[0])
    for a, e in zip(got[1:], want[1:]):
        assert a.dtype == e.dtype and a.shape == e.shape
    with torch._subclasses.FakeTensorMode():  # the fake's outputs are the real op's
        fake = torch.ops.fsg.add_layer_norm_fp8(torch.empty(3, 5, 40, dtype=torch.float16),
                                                 torch.empty(3, 5, 40, dtype=torch.float16), None, None, 1e-5)  # fmt: skip
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in got]


@needs_triton
def test_the_op_on_a_3d_half_precision_input_launches_the_kernel():
    """The registered op flattens ``[B, T, N]`` to rows; its statistics come back in the
    dtype and shape ``aten.native_layer_norm`` gives on the device (CPU: the input's)."""
    x = torch.randn(3, 5, 40, dtype=torch.float16)
    w, b = torch.randn(40, dtype=torch.float16), torch.randn(40, dtype=torch.float16)
    y, mean, rstd, q, inv = L.layer_norm_fp8(x, w, b, 1e-5)
    y_ref, mean_ref, rstd_ref, q_ref, inv_ref = L.layer_norm_fp8_reference(x, w, b, 1e-5)
    for got, want in zip((y, mean, rstd, q, inv), (y_ref, mean_ref, rstd_ref, q_ref, inv_ref)):
        assert got.shape == want.shape and got.dtype == want.dtype
    assert rel(y.float(), y_ref.float()) < 1e-2 and rel(inv, inv_ref) < 1e-2


def test_reference_is_aten_layer_norm_and_the_unfused_rowwise_cast():
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16)
    w, b = torch.randn(32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    y, mean, rstd, q, inv = L.layer_norm_fp8_reference(x, w, b, 1e-5)
    assert torch.equal(y, torch.nn.functional.layer_norm(x, (32,), w, b, 1e-5))
    assert mean.shape == rstd.shape == (2, 6, 1) and q.dtype == torch.float8_e4m3fn and q.shape == (12, 32)
    amax = y.reshape(12, 32).abs().amax(1, keepdim=True).float()
    assert torch.equal(inv, (amax.clamp_min(K.EPS).reciprocal() * 448).reciprocal())


def test_fake_results_match_the_op_on_cpu():
    """The fake (tracing) results have the real results' shapes and dtypes, weights or none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for dtype in (torch.bfloat16, torch.float32):
        for affine in (True, False):
            x = torch.randn(4, 3, 16, dtype=dtype)
            w, b = (torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)) if affine else (None, None)
            real = L.layer_norm_fp8(x, w, b, 1e-5)
            with FakeTensorMode(allow_non_fake_inputs=True):
                fake = torch.ops.fsg.layer_norm_fp8(torch.empty(4, 3, 16, dtype=dtype), w, b, 1e-5)
            assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
