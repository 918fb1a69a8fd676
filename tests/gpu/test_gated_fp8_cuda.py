"""The gated MLP's fused FP8 casts (``kernels/fp8/gated.py``) on CUDA, in bf16: each kernel
against the unfused aten ops, and a Llama-style step under Inductor with the casts fused
against the step whose casts Inductor computes (skipped without a GPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsg
from tests.gpu.test_float8_cuda import assert_fp8_cast, needs_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bf16(shape, scale, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).bfloat16()


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("op", ["gated", "gated_backward", "gated_backward_mul"])
@pytest.mark.parametrize("shape", [(16, 1024, 2816), (3, 100, 200), (2048, 8192)])
def test_fused_gated_kernels_match_the_unfused_ops(shape, op, activation):
    """``g`` to aten's ops (their exp/erf may differ from Triton's in the last bit), the FP8
    copy the cast of the kernel's own ``g`` with its own scales, the scales and column sums to
    the reference's, the column maxima exactly the kernel's ``g``'s."""
    from fsg._src.kernels.fp8 import gated as G

    if op == "gated_backward" and activation != "silu":
        pytest.skip("a GELU's gradient without a factor is gelu_backward_fp8's (test_float8_cuda.py)")
    x, h, dy = _bf16(shape, 2.0, 0), _bf16(shape, 3.0, 1), _bf16(shape, 1e-2, 2)
    if op == "gated":  # g = act(x) * h
        out, ref = G.gated_fp8(x, h, activation, True, True), G.gated_fp8_reference(x, h, activation, True)
    else:  # g = act_backward(dy * x, h), or act_backward(dy, h)
        y = x if op == "gated_backward_mul" else None
        out = G.gated_backward_fp8(dy, h, y, activation, True, True)
        ref = G.gated_backward_fp8_reference(dy, h, y, activation, True)
    g, q, inv, colsum, colamax = out
    g_ref, _, inv_ref, colsum_ref, _ = ref
    torch.testing.assert_close(g, g_ref, rtol=2**-7, atol=2**-8 * float(g_ref.abs().max()) * 2**-8)
    g_MN = g.reshape(q.shape).float()
    assert_fp8_cast(q, g_MN, inv)
    assert torch.equal(colamax, g_MN.abs().amax(0))
    torch.testing.assert_close(inv, g_MN.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448, rtol=1e-6, atol=0)
    torch.testing.assert_close(colsum, g_MN.sum(0), rtol=1e-4, atol=1e-4 * float(g_MN.abs().sum(0).max()))
    torch.testing.assert_close(inv, inv_ref, rtol=2**-7, atol=0)
    torch.testing.assert_close(colsum, colsum_ref, rtol=1e-2, atol=1e-2 * float(colsum_ref.abs().max()))


class _Block(nn.Module):
    """A pre-norm residual block with a gated MLP (no biases)."""

    def __init__(self, width, hidden, act):
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down, self.act = nn.Linear(hidden, width, bias=False), act

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(self.act(self.gate(h)) * self.up(h))


@needs_fp8
@pytest.mark.parametrize("act", [F.silu, lambda v: F.gelu(v, approximate="tanh")], ids=["silu", "gelu_tanh"])
def test_gated_mlp_step_under_inductor_equals_the_unfused_step(act):
    """Inductor + graph replay, two blocks and a head: the step with the fused gated casts
    tracks the one whose casts Inductor builds op by op, and learns."""
    from fsg._src.passes.options import Fusions

    policy = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
    batches = [{"x": _bf16((4, 256, 256), 1.0, 10 + i).float(), "y": _bf16((4, 256, 256), 1.0, 20 + i).float()}
               for i in range(6)]  # fmt: skip
    runs = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(_Block(256, 704, act), _Block(256, 704, act), nn.Linear(256, 256)).cuda()
        step = fsg.compile_step(
            lambda p, b: F.mse_loss(fsg.apply(model, p, b["x"]).float(), b["y"]),
            optimizer=fsg.optim.adamw(1e-3), precision=policy, backend="inductor",
            fusions=Fusions() if fuse else Fusions(fp8_producers=frozenset()),
        )  # fmt: skip
        state = step.init(fsg.params(model))
        counts = step.lower(state, batches[0]).op_counts()
        assert counts.get("fsg.gated_fp8", 0) == (4 if fuse else 0), counts
        assert counts.get("fsg.gated_backward_fp8", 0) == (2 if fuse else 0), counts
        runs[fuse] = []
        for b in batches:
            state, m = step(state, b)
            runs[fuse].append(float(m["loss"]))
    assert max(abs(a - b) for a, b in zip(runs[True], runs[False])) < 1e-2 * runs[False][0], runs
    assert runs[True][-1] < runs[True][0], runs
