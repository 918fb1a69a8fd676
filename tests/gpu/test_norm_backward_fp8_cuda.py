"""``fsg::layer_norm_backward_fp8`` on CUDA (skipped without a GPU): the kernel in bf16 against
aten's layer-norm backward, the add and the rowwise cast, and a GPT step with the fusion under
Inductor and graph replay against the step without it (``FUSE_NORM_BACKWARDS``)."""

import pytest
import torch

from tests.gpu.test_float8_cuda import GPT_CFG, assert_fp8_cast, fused_and_unfused_losses, needs_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(shape, affine, seed=0):
    g_ = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*s, scale=1.0, shift=0.0):
        return (torch.randn(s, generator=g_, device="cuda") * scale + shift).bfloat16()

    N = shape[-1]
    x, dy, r = randn(*shape, scale=2, shift=0.5), randn(*shape, scale=1e-2), randn(*shape, scale=1e-2)
    w, b = (randn(N, scale=0.5, shift=1.0), randn(N, scale=0.1)) if affine else (None, None)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [N], w, b, 1e-5)
    return dy, x, mean, rstd, w, b, r


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(16, 1024, 1024), (3, 100, 200), (2048, 2048), (5000, 768)])
def test_the_kernel_matches_aten_the_add_and_the_rowwise_cast(shape, affine, residual):
    """``dx`` within bf16's rounding of aten's backward plus the residual (the sums' order
    differs), the FP8 copy the cast of the kernel's own ``dx`` with its own scales, ``dw``,
    ``db`` and the column sums to float32 sums' rounding."""
    from fsg._src.kernels import layer_norm_backward_fp8 as B

    dy, x, mean, rstd, w, b, r = _case(shape, affine)
    r = r if residual else None
    mask = [True, affine, affine]
    dx, q, inv, colsum, dw, db = B.layer_norm_backward_fp8(dy, x, mean, rstd, w, b, mask, r, True)
    ref = B.layer_norm_backward_fp8_reference(dy, x, mean, rstd, w, b, mask, r, True)
    scale = float(ref[0].abs().max())
    torch.testing.assert_close(dx.float(), ref[0].float(), rtol=2**-7, atol=scale * 2**-8)
    dx_MN = dx.reshape(q.shape).float()
    assert_fp8_cast(q, dx_MN, inv)
    torch.testing.assert_close(inv, dx_MN.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448, rtol=1e-6, atol=0)
    torch.testing.assert_close(colsum, dx_MN.sum(0), rtol=1e-4, atol=1e-3)
    for got, want in zip((dw, db), ref[4:]):
        assert got.shape == want.shape and got.dtype == want.dtype
        if want.numel():
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=float(want.abs().max()) * 2**-7)


@needs_fp8
def test_rowwise_gpt_step_with_fused_norm_backwards_equals_the_unfused_step(monkeypatch):
    """Inductor + graph replay: the step whose residual-stream gradients come out of
    ``fsg::layer_norm_backward_fp8`` (cast and summed there) tracks the one where Inductor
    computes each norm's backward and ``fsg::rowwise_fp8`` casts the sum."""
    runs = fused_and_unfused_losses(monkeypatch, "FUSE_NORM_BACKWARDS", "layer_norm_backward_fp8", 2 * GPT_CFG.n_layer)
    assert max(abs(a - b) for a, b in zip(runs[True], runs[False])) < 0.02, runs
