"""Bias gradients summed where their rows are produced (``kernels/bias_grad.py``) under
Triton's CPU interpreter against the eager references, and the stage-3 pass that puts them in
a 16-bit graph (``passes/fuse_bias_grads.py``).

The kernel tests use float32 inputs (the interpreter rounds bf16 wrongly, see
test_float8_cast.py); the pass tests run bf16 graphs and compare to a bf16 tolerance."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from fsg._src.kernels import bias_grad as B
from fsg._src.kernels._common import plain_math
from fsg._src.passes import fuse_bias_grads as P
from tests.kernels.common import KERNEL, needs_triton, rel

pytestmark = needs_triton
aten = torch.ops.aten


@KERNEL
@given(st.integers(1, 5), st.integers(1, 60), st.integers(1, 300), st.sampled_from(B.APPROXIMATIONS), st.integers(0, 2**31 - 1))
def test_gelu_backward_colsum_matches_aten(b, t, n, approximate, seed):
    """Rows over several programs and partly masked tiles: ``g`` is aten's ``gelu_backward``
    and the column sums are ``g``'s, whatever the number of rows each program walks."""
    g_ = torch.Generator().manual_seed(seed)
    dy, h = torch.randn(b, t, n, generator=g_), torch.randn(b, t, n, generator=g_) * 3
    g, colsum = B.gelu_backward_colsum(dy, h, approximate)
    g_ref = aten.gelu_backward.default(dy, h, approximate=approximate)
    assert g.shape == dy.shape and colsum.shape == (n,) and colsum.dtype == torch.float32
    assert rel(g, g_ref) < 1e-5 and rel(colsum, g_ref.reshape(-1, n).sum(0)) < 1e-5


@KERNEL
@given(st.integers(2, 3), st.integers(1, 3), st.integers(1, 40), st.integers(1, 4), st.integers(1, 40), st.booleans(), st.integers(0, 2**31 - 1))  # fmt: skip
def test_cat_colsum_reads_strided_pieces(pieces, b, t, heads, d, transposed, seed):
    """The pieces of a qkv gradient as attention's backward leaves them (``[B, H, T, D]``
    seen as ``[B, T, H, D]``): the concatenation along the last dim and its column sums."""
    g_ = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, heads, t, d, generator=g_) for _ in range(pieces)]
    xs = [x.transpose(1, 2) if transposed else x for x in xs]
    g, colsum = B.cat_colsum(xs)
    ref = torch.cat(xs, -1)
    assert torch.equal(g, ref) and rel(colsum, ref.reshape(-1, ref.shape[-1]).sum(0)) < 1e-5


def test_the_ops_fake_shapes_match_the_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    dy, h, xs = torch.randn(2, 5, 32), torch.randn(2, 5, 32), [torch.randn(2, 5, 8) for _ in range(3)]
    real = (*B.gelu_backward_colsum(dy, h, "none"), *B.cat_colsum(xs))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = (*B.gelu_backward_colsum(dy, h, "none"), *B.cat_colsum(xs))
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]


def _block(dy, h, w, q, k, v):
    """What an MLP's and a fused qkv projection's backward do with their bias gradients."""
    g = aten.gelu_backward.default(dy, h, approximate="tanh")
    g2 = g.view(-1, g.shape[-1])
    c = torch.cat([q, k, v], -1)
    c2 = c.view(-1, c.shape[-1])
    return g2 @ w, g2.sum(0), c2.sum([0], keepdim=True), c2.t() @ c2, g.sum(1)


def _inputs(dtype):
    g_ = torch.Generator().manual_seed(0)
    dy, h = torch.randn(2, 16, 64, generator=g_), torch.randn(2, 16, 64, generator=g_) * 2
    w, q, k, v = torch.randn(64, 8, generator=g_), *(torch.randn(2, 16, 8, generator=g_) for _ in range(3))
    return [x.to(dtype) for x in (dy, h, w, q, k, v)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_pass_fuses_bias_gradients_and_keeps_the_results(dtype):
    """Both producers become fused ops; every ``sum(., [0])`` of their rows reads the fused
    column sums (the keepdim one too); a sum over another dim stays; the graph computes what
    it did, to the dtype's rounding."""
    inputs = _inputs(dtype)
    gm = make_fx(_block)(*inputs)
    want = gm(*inputs)
    assert P.fuse_bias_grads(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert P.GELU_BACKWARD_COLSUM in targets and P.CAT_COLSUM in targets
    assert aten.gelu_backward.default not in targets and aten.cat.default not in targets
    assert sum(t is aten.sum.dim_IntList for t in targets) == 1  # g.sum(1)
    got = gm(*inputs)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and rel(a.float(), b.float()) < 2e-2


def test_the_pass_leaves_float32_graphs_producers_without_bias_grads_and_plain_math():
    inputs = _inputs(torch.float32)
    assert P.fuse_bias_grads(make_fx(_block)(*inputs)) == 0  # float32: Inductor's own code
    no_sums = make_fx(lambda dy, h: aten.gelu_backward.default(dy, h) * 2)(*_inputs(torch.bfloat16)[:2])
    assert P.fuse_bias_grads(no_sums) == 0
    with plain_math():
        assert P.fuse_bias_grads(make_fx(_block)(*_inputs(torch.bfloat16))) == 0


def test_the_pipeline_runs_the_pass_only_when_it_is_on(monkeypatch):
    from fsg._src.passes import pipeline

    on_one_device = [p.name for p in pipeline.PASSES if p.applies(pipeline.Options())]
    assert ("fuse_bias_grads" in on_one_device) == P.ENABLED
    monkeypatch.setattr(P, "ENABLED", True)
    assert "fuse_bias_grads" in [p.name for p in pipeline.PASSES if p.applies(pipeline.Options())]
    assert "fuse_bias_grads" not in [p.name for p in pipeline.PASSES if p.applies(pipeline.Options(on_mesh=True))]
