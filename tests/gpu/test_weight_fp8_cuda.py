"""``fsg::weight_fp8`` on CUDA (skipped without a GPU): a weight's two rowwise FP8 casts from its
float32 master, bit for bit the unfused graph's casts of its bf16 copy, and a GPT step with the
fusion under Inductor and graph replay against the step without it (``FUSE_WEIGHTS``)."""

import pytest
import torch

from tests.gpu.test_float8_cuda import GPT_CFG, fused_and_unfused_losses, needs_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("round_to", [torch.bfloat16, None])
@pytest.mark.parametrize("shape", [(3072, 1024), (1024, 4096), (2048, 2048), (100, 200), (1, 7)])
def test_the_kernel_is_the_unfused_casts_bit_for_bit(shape, round_to):
    """The FP8 bytes and inverse scales of ``W`` and ``W.T`` equal the reference's (the
    rounding to bf16 on the GPU as ``.to(bfloat16)`` rounds; maxima exact; the same float32
    arithmetic for the scales), with a zero row and a zero column among them."""
    from fsg._src.kernels import weight_fp8 as W

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
        assert torch.equal(a.view(torch.uint8) if a.dtype == W.E4M3 else a, b.view(torch.uint8) if b.dtype == W.E4M3 else b)


@needs_fp8
def test_rowwise_gpt_step_with_fused_weight_casts_equals_the_unfused_step(monkeypatch):
    """Inductor + graph replay: the step whose block weights are cast by ``fsg::weight_fp8``
    from the float32 masters gives the unfused step's losses (the casts are the same bytes;
    Inductor's own code around them may round its sums differently)."""
    runs = fused_and_unfused_losses(monkeypatch, "FUSE_WEIGHTS", "weight_fp8", 4 * GPT_CFG.n_layer)
    assert max(abs(a - b) for a, b in zip(runs[True], runs[False])) < 0.02, runs
