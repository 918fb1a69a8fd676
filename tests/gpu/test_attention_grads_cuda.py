"""cuDNN's attention backward writing the packed qkv gradient (``kernels/attention_grads.py``,
``passes/pack_attention_grads.py``; skipped without a GPU or NVIDIA's ``cudnn`` package).

The op against torch's cuDNN backward and the concatenation it replaces, over shapes, dtypes,
masks and scales: the same kernels, so equal up to the order of dq's float32 atomic sums
(max difference under 1% of the gradient's largest element; in practice 0 to 1e-6); in a
replayed CUDA graph; and a whole GPT step with the pass on against the same step with it off."""

import pytest
import torch

import fsg
from fsg._src.kernels import attention_grads as A
from fsg._src.passes.options import Fusions
from tests.helpers import gpt_bf16_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
aten = torch.ops.aten


def _problem(B, H, T, D, dtype, causal, scale, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(B, T, 3 * H * D, device="cuda", generator=gen).to(dtype)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    fwd = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    out, lse, seed_t, offset_t = fwd[0], fwd[1], fwd[6], fwd[7]
    g = torch.randn(B, T, H * D, device="cuda", generator=gen).to(dtype).view(B, T, H, D).transpose(1, 2)
    return g, q, k, v, out, lse, seed_t, offset_t


def _concatenated(g, q, k, v, out, lse, seed_t, offset_t, causal, scale):
    B, H, T, D = q.shape
    grads = aten._scaled_dot_product_cudnn_attention_backward(
        g, q, k, v, out, lse, seed_t, offset_t, None, None, None, T, T, 0.0, causal, scale=scale
    )
    return torch.cat([t.transpose(1, 2).reshape(B, T, H * D) for t in grads], -1)


def test_the_cudnn_package_loads_on_this_gpu():
    pytest.importorskip("cudnn")
    assert A.available(torch.device("cuda"))


@pytest.mark.parametrize("B,H,T,D", [(16, 12, 1024, 64), (2, 4, 128, 64), (3, 2, 256, 128), (1, 16, 512, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,scale", [(True, None), (False, None), (True, 0.07)])
def test_the_packed_backward_equals_torchs_backward_and_cat(B, H, T, D, dtype, causal, scale):
    pytest.importorskip("cudnn")
    args = _problem(B, H, T, D, dtype, causal, scale)
    want = _concatenated(*args, causal, scale)
    got = A.attention_backward_packed(*args, causal, scale)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    packed = torch.full((B, T, 3, H, D), float("nan"), dtype=dtype, device="cuda")
    grads = [packed.select(2, i).transpose(1, 2) for i in range(3)]
    g, q, k, v, out, lse = args[:6]
    assert A._packed_backward(g, q, k, v, out, lse, grads, causal, scale)  # cuDNN's path, not the fallback
    assert torch.equal(packed.view(B, T, -1).isnan(), torch.zeros_like(want, dtype=torch.bool))
    assert (packed.view(B, T, -1).float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


def test_the_packed_backward_replays_in_a_cuda_graph():
    pytest.importorskip("cudnn")
    args = _problem(4, 8, 256, 64, torch.bfloat16, True, None, seed=1)
    run = lambda: A.attention_backward_packed(*args, True, None)  # noqa: E731
    direct = run()  # builds the cuDNN graph and the handle, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert (captured.float() - direct.float()).abs().max() <= 1e-2 * direct.float().abs().max()


def test_a_problem_first_met_inside_a_capture_takes_the_aten_backward_there():
    """No cuDNN graph is built while a CUDA graph is captured: that call runs torch's backward
    and the concatenation (replayed alike), and the problem is built at its next call outside."""
    pytest.importorskip("cudnn")
    args = _problem(2, 4, 192, 64, torch.bfloat16, True, None, seed=2)  # a shape no other test uses
    want = _concatenated(*args, True, None)
    assert A.available(torch.device("cuda"))  # the package loaded before the capture
    built = len(A._STATE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = A.attention_backward_packed(*args, True, None)
    graph.replay()
    torch.cuda.synchronize()
    assert len(A._STATE) == built  # nothing built inside the capture
    assert (captured.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    g, q, k, v, out, lse = args[:6]
    B, H, T, D = q.shape
    packed = torch.empty((B, T, 3, H, D), dtype=q.dtype, device="cuda")
    assert A._packed_backward(g, q, k, v, out, lse, [packed.select(2, i).transpose(1, 2) for i in range(3)], True, None)
    assert len(A._STATE) > built  # built at the next call outside


def _gpt_steps(enabled: bool, steps: int = 5, matmul=None):
    config = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    policy = fsg.Policy(compute=torch.bfloat16, matmul=matmul)
    text, losses, _ = gpt_bf16_steps(config, [x] * steps, "cuda", policy, fusions=Fusions(pack_attention_grads=enabled))
    return text, losses


def test_a_gpt_step_with_packed_attention_grads_tracks_the_plain_step_cuda():
    """Five bf16 GPT steps with the pass and without: each layer's backward rewritten, the
    losses within 1e-3 relative (the same cuDNN kernels; only dq's atomic order and Inductor's
    fusions around the removed concatenation differ)."""
    pytest.importorskip("cudnn")
    text, losses = _gpt_steps(True)
    text_off, losses_off = _gpt_steps(False)
    assert text.count("fsg.attention_backward_packed.default(") == 2
    assert "attention_backward_packed" not in text_off and "_scaled_dot_product_cudnn_attention_backward" in text_off
    assert max(abs(a - b) for a, b in zip(losses, losses_off)) < 1e-3 * abs(losses_off[0])


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="needs FP8")
def test_under_rowwise_fp8_the_packed_gradient_feeds_the_fp8_cast_cuda():
    """Rowwise FP8: the packed gradient is cast by ``fsg::rowwise_fp8`` (no ``cat_rowwise_fp8``
    left), and the steps track those with the pass off."""
    pytest.importorskip("cudnn")
    rowwise = fsg.Float8(recipe="rowwise")
    text, losses = _gpt_steps(True, matmul=rowwise)
    text_off, losses_off = _gpt_steps(False, matmul=rowwise)
    assert text.count("fsg.attention_backward_packed.default(") == 2 and "cat_rowwise_fp8" not in text
    assert text_off.count("fsg.cat_rowwise_fp8.default(") == 2
    assert max(abs(a - b) for a, b in zip(losses, losses_off)) < 2e-3 * abs(losses_off[0])
