"""``fsg::weight_fp8`` on CUDA (skipped without a GPU): a weight's two rowwise FP8 casts from its
float32 master against the unfused graph's casts of its bf16 copy, and a GPT step with the
fusion under Inductor and graph replay against the step without it (``Fusions.fp8_weights``)."""

import pytest
import torch

from tests.gpu.test_float8_cuda import GPT_CFG, assert_fp8_cast, fused_and_unfused_losses, needs_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("round_to", [torch.bfloat16, None])
@pytest.mark.parametrize("shape", [(3072, 1024), (1024, 4096), (2048, 2048), (100, 200), (1, 7)])
def test_the_kernel_is_the_unfused_casts(shape, round_to):
    """Both copies are the rows of the weight rounded to bf16 (exactly as ``.to(bfloat16)``
    rounds: the maxima are exact) cast with their own scales; the inverse scales are the
    reference's to Triton's float32 division (1 ulp: ``assert_fp8_cast``), with a zero row and a
    zero column among them at finite scales; layouts and dtypes are the reference's."""
    from fsg._src.kernels.fp8 import weight as W

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(shape, generator=g, device="cuda") * torch.rand(shape[0], 1, generator=g, device="cuda") * 0.05
    w[shape[0] // 2] = 0.0
    w[:, shape[1] // 2] = 0.0
    if round_to is None:
        w = w.bfloat16()
    got = W.weight_fp8(w, round_to)
    want = W.weight_fp8_reference(w, round_to)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    rows = w.to(torch.bfloat16).float()
    for q, inv, r, ref_inv in ((got[0], got[1], rows, want[1]), (got[2], got[3], rows.t(), want[3])):
        assert bool(inv.isfinite().all())
        torch.testing.assert_close(inv, ref_inv, rtol=2.5e-7, atol=0)
        assert_fp8_cast(q, r, inv)
        assert not q[r.abs().amax(1) == 0].float().any()


@needs_fp8
def test_rowwise_gpt_step_with_fused_weight_casts_equals_the_unfused_step():
    """Inductor + graph replay: the step whose block weights are cast by ``fsg::weight_fp8``
    from the float32 masters gives the unfused step's losses (the casts are the same bytes;
    Inductor's own code around them may round its sums differently)."""
    runs = fused_and_unfused_losses("fp8_weights", "weight_fp8", 4 * GPT_CFG.n_layer)
    assert max(abs(a - b) for a, b in zip(runs[True], runs[False])) < 0.02, runs
