"""The last step of Inductor's mix-order reductions on fsg's column-sum kernel (skipped without
a GPU): the kernel against torch, the rewrite in code Inductor generates, and a step with and
without it."""

import pytest
import torch
import torch.nn.functional as F

from fsg._src.backend import column_sums as CS
from fsg._src.kernels import column_sum as K
from fsg._src.passes.options import Fusions
from tests.helpers import gpt_bf16_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("rows,cols", [(1024, 768), (1024, 3072), (128, 2304), (3000, 100), (1, 7)])
def test_column_sum_cuda(rows, cols):
    x = torch.randn(rows, cols, device="cuda") * 10
    got = K.column_sum(x)
    torch.testing.assert_close(got.double(), x.double().sum(dim=0), rtol=1e-5, atol=1e-4 * rows**0.5)
    assert torch.equal(K.column_sum(x), got)  # deterministic


def test_inductor_code_calls_the_kernel_for_a_layer_norm_backward():
    """A layer norm's backward with its weight and bias gradients is a mix-order reduction in
    torch 2.10+: under the context its final sums call ``fsg_column_sum``, and the gradients
    match eager's."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(16384, 768, device="cuda", requires_grad=True)
    w = torch.randn(768, device="cuda", requires_grad=True)
    b = torch.randn(768, device="cuda", requires_grad=True)
    dy = torch.randn(16384, 768, device="cuda")

    def grads(x, w, b, dy):
        return torch.autograd.grad(F.layer_norm(x, (768,), w, b), (x, w, b), dy)

    torch._dynamo.reset()
    with CS.final_sums_as_kernels(Fusions()):
        got, codes = run_and_get_code(torch.compile(grads), x, w, b, dy)
    assert any("fsg_column_sum(" in code for code in codes), "no mix-order reduction was rewritten"
    for g, e in zip(got, grads(x, w, b, dy)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-3)


def _gpt_losses(enabled: bool, monkeypatch) -> tuple[list[float], int]:
    calls = []
    real = K.column_sum
    monkeypatch.setattr(K, "column_sum", lambda x: calls.append(x.shape) or real(x))  # counts the wrapper's calls
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 512, (8, 1025), generator=g) for _ in range(4)]  # 8192 x 768: past the size Inductor fuses at
    config = dict(vocab_size=512, block_size=1024, n_layer=2, n_head=12, n_embd=768)
    return gpt_bf16_steps(config, rows, "cuda", fusions=Fusions(column_sums=enabled))[1], len(calls)


def test_a_gpt_step_with_and_without_the_rewrite(monkeypatch):
    """The step calls the kernel (at its first call and its capture), and trains as the step
    without it does (the sums round differently: close, not equal)."""
    with_kernel, calls = _gpt_losses(True, monkeypatch)
    without, no_calls = _gpt_losses(False, monkeypatch)
    assert calls > 0 and no_calls == 0
    assert max(abs(a - b) for a, b in zip(with_kernel, without)) < 2e-2, (with_kernel, without)
