"""The layer norm backward + residual add + rowwise FP8 cast kernel under Triton's CPU
interpreter, against the unfused graph's ops (``aten.native_layer_norm_backward``, the add, then
the rowwise cast of the sum and its column sums).

float32 inputs and a float32 buffer for the FP8 copy (the interpreter's bf16 rounding and FP8
conversion are wrong: tests/kernels/test_float8_cast.py's docstring); the FP8 bytes and the
bf16 rows are checked on the GPU (tests/gpu/test_float8_cuda.py).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from fsg._src.kernels import float8_cast as K
from fsg._src.kernels import layer_norm_backward_fp8 as B
from fsg._src.kernels._common import RowTiling
from tests.kernels.common import KERNEL, needs_triton, rel


def _case(m, n, seed, dtype=torch.float32, constant_row=True):
    g_ = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g_) * 3 + 1
    if constant_row:
        x[0] = 2.5  # a constant row: xhat is 0, rstd large
    w, b = torch.randn(n, generator=g_), torch.randn(n, generator=g_)
    dy, r = torch.randn(m, n, generator=g_), torch.randn(m, n, generator=g_) * 0.5
    dy[-1] = 0.0
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [n], w, b, 1e-5)
    return [t.to(dtype) for t in (dy, x)] + [mean, rstd] + [t.to(dtype) for t in (w, b, r)]


@needs_triton
@KERNEL
@given(
    st.integers(1, 40), st.integers(1, 300), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
    st.booleans(), st.sampled_from([None, 1, 3]), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_kernel_writes_every_output_and_matches_the_unfused_ops(m, n, has_w, dw, db, colsum, has_r, iters, rows, seed):
    """Tiles and iterations that do not divide M leave partly masked tiles and partial rows of
    zeros; each row's largest element of ``dx`` scales to the FP8 maximum; the partials sum to
    the weight, bias and column sums asked, whichever are."""
    dy, x, mean, rstd, w, b, r = _case(m, n, seed)
    w, r = (w if has_w else None), (r if has_r else None)
    sums = (dw and has_w, db, colsum)
    t = RowTiling(m, n, rows=rows, iters=iters, backward=True)
    dx, q = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))  # q float32: see the docstring
    inv = torch.full((m, 1), float("nan"))
    part = torch.full((t.programs, sum(sums) * n), float("nan")) if any(sums) else None
    B.launch(dy, x, w, mean, rstd, r, dx, q, inv, part, sums, t)
    assert not any(v.isnan().any() for v in (dx, q, inv) + (() if part is None else (part,)))
    ref = B.layer_norm_backward_fp8_reference(dy, x, mean, rstd, w, b, [True, sums[0], db], r, colsum)
    scale = max(1.0, float(ref[0].abs().max()))
    assert (dx - ref[0]).abs().max() < 1e-4 * scale
    # the cast is of dx as the kernel wrote it: its own maxima, exactly as the generic cast computes them
    _, inv_own, colsum_own, _ = K.rowwise_fp8_reference(dx)
    assert rel(inv, inv_own) < 1e-6
    assert rel(q, (dx / inv_own).clamp(-448, 448)) < 1e-5 and bool((q.abs() <= 448).all())
    nonzero = dx.abs().amax(1) > 0
    assert torch.allclose(q.abs().amax(1)[nonzero], torch.tensor(448.0), rtol=1e-6)
    totals = iter(part.sum(0).split(n) if part is not None else ())
    for asked, want in zip(sums, (ref[4], ref[5], colsum_own)):
        if asked:
            got = next(totals)
            assert (got - want).abs().max() < 1e-4 * max(1.0, float(want.abs().max()) * m), (got, want)
    if not has_r:  # dy's last row is zeros: so are dx's and its FP8 copy's, at a finite scale
        assert not dx[-1].any() and not q[-1].any() and bool(inv[-1].isfinite().all())


@needs_triton
@KERNEL
@given(st.integers(1, 30), st.integers(1, 100), st.sampled_from([1, 2]), st.integers(0, 2**31 - 1))
def test_a_pipelined_row_loop_writes_what_the_plain_loop_writes(m, n, stages, seed):
    dy, x, mean, rstd, w, _, r = _case(m, n, seed)
    outs = []
    for s in (1, stages):
        t = RowTiling(m, n, rows=2, iters=3, backward=True, stages=s)
        dx, q, inv, part = torch.empty(m, n), torch.empty(m, n), torch.empty(m, 1), torch.empty(t.programs, 3 * n)
        B.launch(dy, x, w, mean, rstd, r, dx, q, inv, part, (True, True, True), t)
        outs.append((dx, q, inv, part))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, True), (True, True, False), (True, False, False)])
@pytest.mark.parametrize("affine", [True, False])
def test_reference_is_aten_then_the_add_then_the_unfused_rowwise_cast(dtype, mask, affine):
    """The op off the kernel's path (here: CPU) runs the unfused graph's ops, bit for bit, and
    its fake results have its real results' shapes and dtypes."""
    dy, x, mean, rstd, w, b, r = (t.reshape(2, 6, -1) if t.dim() == 2 else t for t in _case(12, 32, 0, dtype))
    mean, rstd = mean.to(dtype), rstd.to(dtype)  # as the forward gives them on CPU
    w, b = (w, b) if affine else (None, None)
    mask = (True, mask[1] and affine, mask[2] and affine)  # aten asks a weight for its gradient
    for residual in (r, None):
        out = B.layer_norm_backward_fp8(dy, x, mean, rstd, w, b, list(mask), residual, True)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward.default(dy, x, [32], mean, rstd, w, b, list(mask))
        dx = dx if residual is None else residual + dx
        assert torch.equal(out[0], dx)
        q, inv, colsum, _ = K.rowwise_fp8_reference(dx)
        assert torch.equal(out[1].float(), q.float()) and torch.equal(out[2], inv) and torch.equal(out[3], colsum)
        for got, want in zip(out[4:], (dw, db)):
            assert got.numel() == 0 if want is None else torch.equal(got, want)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = torch.ops.fsg.layer_norm_backward_fp8(dy, x, mean, rstd, w, b, list(mask), residual, True)
        assert [(f.shape, f.dtype) for f in fake] == [(o.shape, o.dtype) for o in out]


def test_column_sums_not_asked_come_back_empty():
    dy, x, mean, rstd, w, b, r = _case(8, 16, 1, torch.bfloat16)
    out = B.layer_norm_backward_fp8(dy, x, mean.to(x.dtype), rstd.to(x.dtype), w, b, [True, True, True], r, False)
    assert out[3].shape == (0,) and out[3].dtype == torch.float32
