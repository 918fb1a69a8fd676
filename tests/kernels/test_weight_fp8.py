"""A weight's two rowwise FP8 casts (of ``W`` and of ``W.T``) in two launches, under Triton's CPU
interpreter, against the unfused graph's casts (``weight_fp8_reference``).

float32 buffers for the FP8 copies (the interpreter's FP8 conversion is wrong:
tests/kernels/test_float8_cast.py's docstring); its bf16 rounding is wrong too, so the
rounding path runs on values bf16 holds exactly, where it must change nothing. The FP8 bytes
and the rounding of the float32 master are checked on the GPU (tests/gpu/test_weight_fp8_cuda.py).
"""

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from fsg._src.kernels.fp8 import cast as K
from fsg._src.kernels.fp8 import weight as W
from tests.kernels.common import KERNEL, needs_triton, rel


def _launch(w, round_to=None, block=(W.BLOCK_N, W.BLOCK_K)):
    N, K_ = w.shape
    nan = float("nan")
    outs = torch.full((N, K_), nan), torch.full((N, 1), nan), torch.full((K_, N), nan), torch.full((K_, 1), nan)
    W.launch(w, round_to, torch.zeros(N + K_), *outs, block=block)
    return outs


def _check(w, outs, round_to=None):
    """Each copy is its rows scaled by their own maxima to the FP8 range, with the reference's
    inverse scales exactly; a row with a nonzero element reaches the FP8 maximum."""
    q, inv, qt, inv_t = outs
    _, ref_inv, _, ref_inv_t = W.weight_fp8_reference(w, round_to)
    assert torch.equal(inv, ref_inv) and torch.equal(inv_t, ref_inv_t)
    for rows, got, scales in ((w.float(), q, inv), (w.float().t(), qt, inv_t)):
        assert rel(got, (rows / scales).clamp(-448, 448)) < 1e-5 and bool((got.abs() <= 448).all())
        nonzero = rows.abs().amax(1) > 0
        assert torch.allclose(got.abs().amax(1)[nonzero], torch.tensor(448.0), rtol=1e-6)
        assert not got[~nonzero].any() and bool(scales.isfinite().all())


@needs_triton
@KERNEL
@example(64, 64, 64, 64, False, 0)  # one whole tile
@example(1, 1, 16, 16, False, 1)
@given(
    st.integers(1, 150), st.integers(1, 150), st.sampled_from([16, 32, 64]), st.sampled_from([16, 32, 64]),
    st.booleans(), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_kernel_casts_both_layouts_as_the_unfused_casts(n, k, bn, bk, transposed, seed):
    """Tiles that do not divide the weight leave masked edges; a zero row and a zero column get
    finite scales and zeros; a weight read through its transpose (strided) is cast as its values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    w[n // 2] = 0.0
    w[:, k // 2] = 0.0
    if transposed:
        w = w.t().contiguous().t()
    _check(w, _launch(w, block=(bn, bk)))


@needs_triton
@KERNEL
@given(st.integers(1, 80), st.integers(1, 80), st.integers(0, 2**31 - 1))
def test_rounding_to_the_compute_dtype_keeps_values_it_holds(n, k, seed):
    """A float32 master whose values bfloat16 holds exactly: rounding first changes nothing."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()
    outs = _launch(w, torch.bfloat16, block=(32, 32))
    assert all(torch.equal(a, b) for a, b in zip(outs, _launch(w, None, block=(32, 32))))
    _check(w, outs, torch.bfloat16)


@given(st.integers(1, 40), st.integers(1, 40), st.sampled_from([None, torch.bfloat16, torch.float16]))
@KERNEL
def test_the_reference_is_the_unfused_graphs_casts_and_the_fake_matches(n, k, round_to):
    """``weight_fp8_reference`` is the rowwise cast of the rounded weight and of its transpose,
    as ``Quantizer.rowwise_operand`` builds them (``rowwise_fp8_reference``), bit for bit; the
    op's fake gives the real outputs' shapes, dtypes and strides (the kernel's under the
    interpreter, and the reference's, which the op runs on CPU)."""
    w = torch.randn(n, k) * 3
    got = W.weight_fp8_reference(w, round_to)
    rounded = (w if round_to is None else w.to(round_to)).float()
    rows, cols = K.rowwise_fp8_reference(rounded), K.rowwise_fp8_reference(rounded.t())
    for a, b in zip(got, (rows[0], rows[1], cols[0], cols[1])):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float())
    with FakeTensorMode() as mode:
        fake = torch.ops.fsg.weight_fp8(mode.from_tensor(w), round_to)
    for f, r, e in zip(fake, torch.ops.fsg.weight_fp8(w, round_to), got):  # the kernel's, the reference's
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride()) == (e.shape, e.dtype, e.stride())


def test_bad_weights_are_refused_with_the_rule():
    import pytest

    with pytest.raises(ValueError, match="2-D weight"):
        torch.ops.fsg.weight_fp8(torch.randn(2, 3, 4), None)
    with pytest.raises(ValueError, match="float32 one"):
        torch.ops.fsg.weight_fp8(torch.randn(2, 3, dtype=torch.bfloat16), torch.bfloat16)
