"""The ``gemm_epilogues`` pass (``passes/gemm_epilogues.py``) and its ops
(``kernels/linear_gelu.py``) on CPU.

Off CUDA the ops run the aten ops they replace, so a rewritten graph must compute exactly what
the original did: the rewrite is checked bit for bit on traced MLP graphs over drawn shapes and
on whole GPT steps, and every case the pass must leave alone is checked to be left alone. The
cuBLASLt epilogues themselves are checked on the GPU (tests/gpu/test_linear_gelu_cuda.py)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from fsg._src.kernels import cublaslt
from fsg._src.kernels import linear_gelu as L
from fsg._src.passes import gemm_epilogues as P
from fsg._src.passes import pipeline
from fsg._src.passes.options import Fusions
from tests.helpers import tiny_gpt_run

aten = torch.ops.aten
BF16 = torch.bfloat16


def _randn(*shape, seed=0, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _mlp_joint(approximate="tanh", bias=True, alpha=1):
    """An MLP block's loss and gradients, as one traced joint graph:
    ``fc2(gelu(fc1(x)))`` with ``x`` of ``[B, T, D]``."""

    def step(x, w1, b1, w2, b2, c):
        args = [t.detach().requires_grad_(i in (1, 2, 3)) for i, t in enumerate((x, w1, b1, w2, b2, c))]
        x, w1, b1, w2, b2, c = args
        if alpha == 1:
            h = F.linear(x, w1, b1 if bias else None)
        else:
            h = torch.addmm(b1, x.flatten(0, -2), w1.t(), alpha=alpha).view(*x.shape[:-1], -1)
        y = F.linear(F.gelu(h, approximate=approximate), w2, b2)
        loss = (y.float() * c.float()).sum()
        return (loss.detach(), *torch.autograd.grad(loss, [w1, b1, w2], allow_unused=True))

    return step


def _inputs(B, T, D, H, dtype=BF16):
    return [_randn(B, T, D, seed=1, dtype=dtype), _randn(H, D, seed=2, dtype=dtype, scale=D**-0.5),
            _randn(H, seed=3, dtype=dtype), _randn(D, H, seed=4, dtype=dtype, scale=H**-0.5),
            _randn(D, seed=5, dtype=dtype), _randn(B, T, D, seed=6, dtype=dtype)]  # fmt: skip


ON_CPU = Fusions(on_cpu={"gemm_epilogues"})
FORWARD_ONLY = Fusions(on_cpu={"gemm_epilogues"}, gemm_epilogue_backward=False)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@settings(max_examples=15, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4).map(lambda t: 8 * t),
    st.sampled_from([8, 16, 32]),
    st.sampled_from([8, 32, 64]),
)
def test_the_rewritten_mlp_computes_exactly_what_it_did(B, T, D, H):
    """Forward and backward become one op each; the bias gradient of ``fc1`` sums the op's
    ``dh``; the loss and every gradient are the original graph's bit for bit (the ops' CPU path)."""
    inputs = _inputs(B, T, D, H)
    gm = make_fx(_mlp_joint())(*inputs)
    want = gm(*inputs)
    assert P.gemm_epilogues(gm, ON_CPU) == 2
    targets = _targets(gm)
    assert targets.count(P.LINEAR_GELU) == 1 and targets.count(P.MM_GELU_BACKWARD) == 1
    assert aten.gelu.default not in targets and aten.gelu_backward.default not in targets
    for got, ref in zip(gm(*inputs), want):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


@pytest.mark.parametrize(
    "case, kwargs, shape, backward_fused",
    [
        ("erf GELU (cuBLASLt's is the tanh one)", {"approximate": "none"}, (2, 8, 16, 32), False),
        ("alpha != 1", {"alpha": 2}, (2, 8, 16, 32), True),
        ("a width not a multiple of 8", {}, (2, 8, 16, 36), False),
    ],
)
def test_what_the_epilogues_cannot_take_is_left_alone(case, kwargs, shape, backward_fused):
    """The forward stays unfused in each case; the backward half, which stands alone, fuses
    where only the forward's pattern is broken; the graph computes what it did."""
    inputs = _inputs(*shape)
    gm = make_fx(_mlp_joint(**kwargs))(*inputs)
    before, want = gm.code, gm(*inputs)
    fused = P.gemm_epilogues(gm, ON_CPU)
    assert fused == int(backward_fused) and P.LINEAR_GELU not in _targets(gm), case
    assert backward_fused or gm.code == before
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(gm(*inputs), want))


def test_a_linear_without_bias_fuses_too():
    """``gelu(mm(x, w_t))``: the epilogue without a bias (``GELU_AUX``); results unchanged."""
    inputs = _inputs(2, 8, 16, 32)
    gm = make_fx(_mlp_joint(bias=False))(*inputs)
    want = gm(*inputs)
    assert P.gemm_epilogues(gm, ON_CPU) == 2
    op = next(n for n in gm.graph.nodes if n.target is P.LINEAR_GELU)
    assert op.args[2] is None
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(gm(*inputs), want))


def test_with_the_backward_half_off_only_the_forward_half_is_fused():
    inputs = _inputs(2, 8, 16, 32)
    gm = make_fx(_mlp_joint())(*inputs)
    want = gm(*inputs)
    assert P.gemm_epilogues(gm, FORWARD_ONLY) == 1
    targets = _targets(gm)
    assert P.LINEAR_GELU in targets and P.MM_GELU_BACKWARD not in targets and aten.gelu_backward.default in targets
    assert all(torch.equal(a, b) for a, b in zip(gm(*inputs), want))


def test_float32_and_cpu_graphs_unless_named_in_on_cpu_are_left_alone():
    inputs = _inputs(2, 8, 16, 32)
    gm = make_fx(_mlp_joint())(*inputs)
    assert P.gemm_epilogues(gm) == 0  # CPU tensors: the ops would only run the aten ops
    inputs32 = _inputs(2, 8, 16, 32, dtype=torch.float32)
    gm32 = make_fx(_mlp_joint())(*inputs32)
    assert P.gemm_epilogues(gm32, ON_CPU) == 0


def test_a_grad_input_read_elsewhere_keeps_its_matmul():
    """``da = g @ w2`` also returned: the backward cannot drop it, so only the forward fuses."""

    def step(x, w1, b1, w2, g):
        h = torch.addmm(b1, x, w1.t())
        da = g @ w2
        return F.gelu(h, approximate="tanh"), aten.gelu_backward.default(da, h, approximate="tanh"), da

    inputs = [
        _randn(16, 8, seed=1),
        _randn(32, 8, seed=2),
        _randn(32, seed=3),
        _randn(8, 32, seed=4),
        _randn(16, 8, seed=5),
    ]
    gm = make_fx(step)(*inputs)
    want = gm(*inputs)
    assert P.gemm_epilogues(gm, ON_CPU) == 1
    assert P.MM_GELU_BACKWARD not in _targets(gm)
    assert all(torch.equal(a, b) for a, b in zip(gm(*inputs), want))


def test_the_ops_fake_shapes_match_the_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w_t, b, g, w, h = _randn(16, 8), _randn(8, 24), _randn(24), _randn(16, 24), _randn(24, 8), _randn(2, 8, 8)
    real = (*L.linear_gelu(x, w_t, b), *L.mm_gelu_backward(g, w, h))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = (*L.linear_gelu(x, w_t, b), *L.mm_gelu_backward(g, w, h))
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]
    assert not L.fusable(x, w_t, b)  # CPU: the aten ops


def test_the_pipeline_runs_it_after_float8_before_the_batched_casts_also_on_a_mesh():
    names = [p.name for p in pipeline.order(list(pipeline.PASSES))]
    assert names.index("float8") < names.index("gemm_epilogues") < names.index("batch_casts")
    by_name = {p.name: p for p in pipeline.PASSES}
    assert by_name["gemm_epilogues"].applies(pipeline.Options())
    assert by_name["gemm_epilogues"].applies(pipeline.Options(on_mesh=True))  # tests/dist/test_precision.py


def _gpt_run(forced: bool, backward=True):
    return tiny_gpt_run({"gemm_epilogues"} if forced else frozenset(), fusions={"gemm_epilogue_backward": backward})


@functools.cache
def _plain_gpt_run():
    """The plain step both parametrizations below compare with (run once: it is the same step)."""
    return _gpt_run(False)


@pytest.mark.parametrize("backward", [False, True])
def test_a_gpt_step_with_the_ops_in_place_equals_the_plain_step(backward):
    """examples/gpt.py's GPT under bf16: every layer's MLP rewritten (the forward; the backward
    too unless turned off), and three steps end with the plain step's loss and parameters, bit
    for bit."""
    text, loss, params = _gpt_run(True, backward=backward)
    text_plain, loss_plain, params_plain = _plain_gpt_run()
    assert text.count("fsg.linear_gelu.default(") == 2
    assert text.count("fsg.mm_gelu_backward.default(") == (2 if backward else 0)
    assert "fsg.linear_gelu" not in text_plain and ("aten.gelu_backward" in text) is not backward
    assert loss == loss_plain
    assert all(torch.equal(params[k], params_plain[k]) for k in params)


# -- the row-major to column-major mapping of kernels/cublaslt.py ---------------------------


def _laid_out(rows, cols, layout, seed):
    """A [rows, cols] float64 tensor: row-major, column-major (a transposed view) or row-major
    with a padded leading dim (a slice of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "row":
        return torch.randn(rows, cols, generator=g, dtype=torch.float64)
    if layout == "col":
        return torch.randn(cols, rows, generator=g, dtype=torch.float64).t()
    return torch.randn(rows, cols + 3, generator=g, dtype=torch.float64)[:, 1 : cols + 1]


def _column_major(t, op, ld, rows, cols):
    """``op(X)`` for the column-major ``rows x cols`` matrix ``X`` that cuBLASLt reads at ``t``'s
    memory with leading dim ``ld``."""
    x = torch.as_strided(t, (rows, cols), (1, ld), t.storage_offset())
    return x if op == cublaslt._OP_N else x.t()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9), st.sampled_from(["row", "col", "padded"]),
       st.sampled_from(["row", "col", "padded"]), st.integers(0, 2**31 - 1))  # fmt: skip
def test_the_column_major_call_computes_the_row_major_product(M, K, N, layout_a, layout_b, seed):
    """What ``matmul`` hands cuBLASLt (``_operand``'s op and leading dim, the layouts' shapes),
    evaluated as cuBLASLt reads memory (column-major), is ``a @ b`` in ``out``'s row-major
    memory: ``D (N x M) = op(b) @ op(a)``."""
    a, b = _laid_out(M, K, layout_a, seed), _laid_out(K, N, layout_b, seed + 1)
    (op_a, ld_a), (op_b, ld_b) = cublaslt._operand(a), cublaslt._operand(b)
    A = _column_major(b, op_b, ld_b, *((N, K) if op_b == cublaslt._OP_N else (K, N)))
    B = _column_major(a, op_a, ld_a, *((K, M) if op_a == cublaslt._OP_N else (M, K)))
    assert A.shape == (N, K) and B.shape == (K, M)
    D = A @ B  # column-major N x M with ld N is the row-major [M, N] result
    assert torch.allclose(D.t(), a @ b)


def test_operands_cublaslt_cannot_read_as_they_lie_are_refused():
    x = torch.randn(16, 32, dtype=BF16)
    assert cublaslt._operand(x[:, ::2]) is None  # neither dim unit-strided
    assert not cublaslt.supports(x, torch.randn(32, 8, dtype=torch.float32))  # dtypes differ
    assert not cublaslt.supports(x, torch.randn(32, 12, dtype=BF16))  # 12 not a multiple of 8
    assert cublaslt.supports(x, torch.randn(8, 32, dtype=BF16).t())
    assert not cublaslt.available(torch.device("cpu"))
