"""RMSNorm and LayerNorm kernels on CUDA, float32 and bfloat16 (skipped without a GPU).

Tolerances (relative L2 error against the float64 reference): float32 1e-5; bfloat16 1e-2
(bf16 inputs and outputs, float32 statistics).
"""

import pytest
import torch

from fsg._src.kernels import rms_norm as K
from tests.helpers import rel_err as rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 123), (4096, 768), (3, 7, 1000)])
def test_forward_and_backward_match_float64(dtype, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    y = K.rms_norm(x, w, 1e-6)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = torch.nn.functional.rms_norm(x64, (shape[-1],), w64, eps=1e-6)
    y64.backward(dy.double())
    assert rel(y, y64) < TOL[dtype]
    assert rel(x.grad, x64.grad) < TOL[dtype] and rel(w.grad, w64.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 123), (4096, 768), (3, 7, 1000)])
def test_layer_norm_forward_and_backward_match_float64(dtype, shape):
    import fsg

    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    fsg.nn.layer_norm(x, w, b, 1e-5).backward(dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.layer_norm(x64, (shape[-1],), w64, b64, eps=1e-5).backward(dy.double())
    assert (
        rel(x.grad, x64.grad) < TOL[dtype] and rel(w.grad, w64.grad) < TOL[dtype] and rel(b.grad, b64.grad) < TOL[dtype]
    )
