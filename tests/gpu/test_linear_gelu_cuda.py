"""cuBLASLt's GELU epilogues on CUDA (``kernels/cublaslt.py``, ``kernels/linear_gelu.py``,
``passes/gemm_epilogues.py``; skipped without a GPU).

Each fused op against a float32 reference from the same bf16 inputs: relative L2 error under
1e-2 (bf16 carries 8 bits); the GELU must be the tanh one (at least as many elements equal
to the tanh reference rounded to bf16 as to the erf GELU's); and a whole GPT step with the pass
on against the same step with it off."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fsg
from fsg._src.kernels import cublaslt
from fsg._src.kernels import linear_gelu as L
from fsg._src.passes.options import Fusions
from tests.helpers import rel_err as rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16 = torch.bfloat16
SHAPES = [(16384, 768, 3072), (1000, 256, 1024), (8, 64, 8), (4096, 2048, 8192)]  # (M, K, N)


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(BF16)


def test_cublaslt_loads_on_this_gpu():
    assert cublaslt.available(torch.device("cuda")), cublaslt._library_path()


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("weight_layout", ["transposed", "row_major"])
def test_linear_gelu_matches_float32_cuda(M, K, N, weight_layout):
    gen = torch.Generator(device="cuda").manual_seed(M + N)
    x, b = _randn(M, K, gen=gen), _randn(N, gen=gen, scale=0.5)
    w_t = _randn(N, K, gen=gen, scale=K**-0.5).t() if weight_layout == "transposed" else _randn(K, N, gen=gen, scale=K**-0.5)
    assert L.fusable(x, w_t, b)
    y, h = L.linear_gelu(x, w_t, b)
    h32 = x.float() @ w_t.float() + b.float()
    y32 = F.gelu(h32, approximate="tanh")
    assert y.dtype == h.dtype == BF16 and y.shape == h.shape == (M, N)
    assert rel(h, h32) < 1e-2 and rel(y, y32) < 1e-2
    same_tanh = (y == y32.to(BF16)).float().mean()
    same_erf = (y == F.gelu(h32).to(BF16)).float().mean()
    assert same_tanh >= same_erf, (float(same_tanh), float(same_erf))


def test_linear_gelu_without_bias_matches_float32_cuda():
    gen = torch.Generator(device="cuda").manual_seed(3)
    x, w_t = _randn(4096, 768, gen=gen), _randn(3072, 768, gen=gen, scale=768**-0.5).t()
    y, h = L.linear_gelu(x, w_t, None)
    h32 = x.float() @ w_t.float()
    assert rel(h, h32) < 1e-2 and rel(y, F.gelu(h32, approximate="tanh")) < 1e-2


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("weight_layout", ["row_major", "transposed"])
def test_mm_gelu_backward_matches_float32_cuda(M, K, N, weight_layout):
    """``g [M, N] @ w [N, K]``: the down-projection's grad-input, then the GELU gradient at ``h``."""
    gen = torch.Generator(device="cuda").manual_seed(M + K)
    g, h = _randn(M, N, gen=gen), _randn(M, K, gen=gen, scale=2.0)
    w = _randn(N, K, gen=gen, scale=N**-0.5) if weight_layout == "row_major" else _randn(K, N, gen=gen, scale=N**-0.5).t()
    assert L.fusable(g, w, h)
    dh = L.mm_gelu_backward(g, w, h)
    dh32 = torch.ops.aten.gelu_backward.default(g.float() @ w.float(), h.float(), approximate="tanh")
    assert dh.shape == (M, K) and dh.dtype == BF16 and rel(dh, dh32) < 1e-2


def test_operands_cublaslt_cannot_take_run_the_aten_ops_cuda():
    """Dims not in multiples of 8, or a misaligned pre-activation: the unfused ops, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w_t, b = _randn(1001, 64, gen=gen), _randn(64, 128, gen=gen), _randn(128, gen=gen)
    assert not L.fusable(x, w_t, b)
    y, h = L.linear_gelu(x, w_t, b)
    assert torch.equal(h, torch.addmm(b, x, w_t)) and torch.equal(y, F.gelu(h, approximate="tanh"))
    g, w, h = _randn(64, 128, gen=gen), _randn(128, 64, gen=gen), _randn(64 * 64 + 1, gen=gen)[1:].view(64, 64)
    assert not L.fusable(g, w, h)  # h 2 bytes past an aligned address
    dh = L.mm_gelu_backward(g, w, h)
    assert torch.equal(dh, torch.ops.aten.gelu_backward.default(g @ w, h, approximate="tanh"))


def test_the_fused_ops_replay_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x, w_t, b = _randn(512, 256, gen=gen), _randn(1024, 256, gen=gen).t(), _randn(1024, gen=gen)
    g, w2 = _randn(512, 256, gen=gen), _randn(256, 1024, gen=gen)
    run = lambda: (*L.linear_gelu(x, w_t, b), L.mm_gelu_backward(g, w2, L.linear_gelu(x, w_t, b)[1]))  # noqa: E731
    run()  # the heuristics and the workspace, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for t in (x, b, g):
        t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(BF16))
    graph.replay()
    torch.cuda.synchronize()
    for replayed, direct in zip(outs, run()):
        assert torch.equal(replayed, direct)


def _gpt_steps(enabled: bool, compute=BF16, steps: int = 5, backward=True):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)).cuda()

    def loss_fn(params, batch):
        return fsg.apply(model, params, batch["x"], batch["y"])

    fusions = Fusions(gemm_epilogues=enabled, gemm_epilogue_backward=backward)
    step = fsg.compile_step(
        loss_fn, optimizer=fsg.optim.adamw(1e-3), precision=fsg.Policy(compute=compute), fusions=fusions
    )
    state = step.init(fsg.params(model))
    x = torch.randint(0, 256, (8, 65), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    batch = {"x": x[:, :-1], "y": x[:, 1:]}
    text = step.lower(state, batch).as_text()
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return text, losses, torch.cat([p.flatten() for p in state.params.values()])


@pytest.mark.parametrize("backward", [False, True])
def test_gpt_step_with_the_epilogues_is_as_close_to_float32_as_without_cuda(backward):
    """Five bf16 steps of a GPT with the epilogues (the forward's; the backward's too unless
    turned off) and without, each against float32 steps from
    the same init: the fused step's parameters no further from float32's than the unfused
    step's (by more than a quarter), its losses within bf16's reach of them."""
    text, losses, params = _gpt_steps(True, backward=backward)
    text_off, losses_off, params_off = _gpt_steps(False)
    _, losses32, params32 = _gpt_steps(True, compute=torch.float32)
    assert text.count("fsg.linear_gelu.default(") == 2
    assert text.count("fsg.mm_gelu_backward.default(") == (2 if backward else 0)
    assert "fsg.linear_gelu" not in text_off
    assert max(abs(a - b) for a, b in zip(losses, losses32)) < 2e-2 * abs(losses32[0])
    assert rel(params, params32) <= 1.25 * rel(params_off, params32) + 1e-5


def test_each_heuristic_candidate_computes_the_same_cuda():
    """``matmul(..., algo=i)`` for every candidate cuBLASLt offers, each within bf16 rounding
    of float32; past the last candidate a clear error."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x, w_t, b = _randn(2048, 512, gen=gen), _randn(1536, 512, gen=gen, scale=512**-0.5).t(), _randn(1536, gen=gen)
    y32 = F.gelu(x.float() @ w_t.float() + b.float(), approximate="tanh")
    h, i = torch.empty(2048, 1536, dtype=BF16, device="cuda"), 0
    while True:
        try:
            y = cublaslt.matmul(x, w_t, cublaslt.EPILOGUE_GELU_AUX_BIAS, bias=b, aux=h, algo=i)
        except cublaslt.CublasLtError as exc:
            assert "algorithms here" in str(exc)
            break
        assert rel(y, y32) < 1e-2, i
        i += 1
    assert i >= 1
