"""The fused rowwise FP8 cast kernel (each producer: a GELU gradient, a GELU, a concatenation,
the rows as given) under Triton's CPU interpreter, against the eager references (the unfused
graph's ops).

float32 inputs (the interpreter's bf16 rounding is wrong). Its FP8 conversion is wrong too
(31.17 becomes 16: a rounding carry is lost), so the launch tests hand the kernel a float32
buffer for the FP8 copy and check the scaled, saturated values it would convert; the FP8
bytes themselves are checked on the GPU (tests/gpu/test_float8_cuda.py).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsg._src.kernels._common import RowTiling
from fsg._src.kernels.fp8 import cast as K
from fsg._src.kernels.fp8 import cast_kernel as KK
from tests.kernels.common import KERNEL, needs_triton, rel


def check_against_reference(dy, h, approximate, g, scaled, inv, colsum):
    """``scaled``: the kernel's FP8 copy before conversion (float32), or the FP8 copy."""
    g_ref, _, inv_ref, colsum_ref, _ = K.gelu_backward_fp8_reference(dy, h, approximate)
    assert rel(g, g_ref) < 1e-5 and rel(inv, inv_ref) < 1e-5 and rel(colsum, colsum_ref) < 1e-5
    assert inv.shape == inv_ref.shape == (scaled.shape[0], 1) and colsum.shape == (scaled.shape[1],)
    want = (g_ref.reshape(scaled.shape).float() / inv_ref).clamp(-448, 448)
    if scaled.dtype == torch.float32:
        assert rel(scaled, want) < 1e-5 and bool((scaled.abs() <= 448).all())
    else:
        assert scaled.dtype == torch.float8_e4m3fn and scaled.shape == want.shape


@needs_triton
@KERNEL
@given(
    st.integers(1, 40), st.integers(1, 300), st.sampled_from(K.APPROXIMATIONS), st.sampled_from([None, 1, 3]),
    st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 3]),
)  # fmt: skip
def test_kernel_writes_every_output_and_matches_the_reference(m, n, approximate, iters, rows, seed, stages):
    """Tiles and iterations that do not divide M leave partly masked tiles (a pipelined row
    loop too: ``stages``); a row of zeros
    gets a finite scale; each row's largest element scales to the FP8 maximum; the column
    maxima are those of ``|g|`` as written, exactly."""
    g_ = torch.Generator().manual_seed(seed)
    # |h| <= 5: past -5, gelu'(h) (~1e-8) is float32's cancellation noise in aten's and the
    # kernel's erf alike, and a row of one such element scales its noise (even its sign) to 448
    dy, h = torch.randn(m, n, generator=g_) * 2, (torch.randn(m, n, generator=g_) * 3).clamp(-5, 5)
    dy[0] = 0.0
    t = RowTiling(m, n, rows=rows, iters=iters, stages=stages)
    g = torch.full((m, n), float("nan"))
    q = torch.full((m, n), float("nan"))  # float32: see the module docstring
    inv = torch.full((m, 1), float("nan"))
    part, amax_part = torch.full((t.programs, n), float("nan")), torch.zeros(1 + seed % 3, n)  # any rows: folded
    K.launch([dy], h, g, q, inv, part, f"gelu_backward:{approximate}", t, amax_part)
    assert not (g.isnan().any() or q.isnan().any() or inv.isnan().any() or part.isnan().any())
    check_against_reference(dy, h, approximate, g, q, inv, part.sum(0))
    assert torch.equal(amax_part.amax(0), g.abs().amax(0))
    nonzero = g.abs().amax(1) > 0
    assert torch.allclose(q.abs().amax(1)[nonzero], torch.tensor(448.0), rtol=1e-6) and not q[0].any()


@needs_triton
@pytest.mark.parametrize("approximate", K.APPROXIMATIONS)
def test_the_op_on_3d_inputs_launches_the_kernel(approximate):
    """The registered op flattens ``[B, T, N]`` to rows and sums the column partials."""
    dy, h = torch.randn(3, 7, 48), torch.randn(3, 7, 48) * 4
    g, q, inv, colsum, colamax = K.gelu_backward_fp8(dy, h, approximate)
    assert g.shape == dy.shape and q.shape == (21, 48) and colsum.shape == (48,) and colamax.shape == (0,)
    check_against_reference(dy, h, approximate, g, q, inv, colsum)
    *_, colamax = K.gelu_backward_fp8(dy, h, approximate, True)
    assert torch.equal(colamax, g.reshape(21, 48).abs().amax(0))


@pytest.mark.parametrize("approximate", K.APPROXIMATIONS)
def test_reference_is_aten_gelu_backward_and_the_unfused_rowwise_cast(approximate):
    """The reference (the op on CPU outside the interpreter) is the graph the pass replaces:
    ``aten.gelu_backward`` in the input dtype, then the rowwise cast of its bfloat16 rows."""
    dy, h = torch.randn(10, 64, dtype=torch.bfloat16), torch.randn(10, 64, dtype=torch.bfloat16) * 3
    g, q, inv, colsum, colamax = K.gelu_backward_fp8_reference(dy, h, approximate, column_amax=True)
    gelu = torch.nn.functional.gelu
    h_ = h.float().requires_grad_()
    (gelu(h_, approximate=approximate) * dy.float()).sum().backward()
    assert g.dtype == torch.bfloat16 and rel(g.float(), h_.grad) < 1e-2
    scale = 448.0 / g.float().abs().amax(1, keepdim=True)
    assert torch.equal(q, (g.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn))
    assert rel(inv, 1 / scale) < 1e-6 and rel(colsum, g.float().sum(0)) < 1e-6
    unfused = torch.ops.aten.amax.default(torch.ops.aten.abs.default(g.t()), [1], True)  # the pass's flipped scale
    assert torch.equal(colamax, unfused.float().view(-1))


@pytest.mark.parametrize("column_amax", [False, True])
def test_fake_shapes_match_the_real_op(column_amax):
    dy = torch.randn(2, 5, 32)
    real = K.gelu_backward_fp8(dy, torch.randn(2, 5, 32), "tanh", column_amax)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = K.gelu_backward_fp8(mode.from_tensor(dy), mode.from_tensor(dy), "tanh", column_amax)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


@needs_triton
@given(st.integers(1, 1 << 17), st.sampled_from(sorted(KK.TILES)), st.integers(0, 1))
def test_a_measured_tiling_covers_every_row_once_with_its_warps_and_programs(m, entry, narrower):
    """Each ``TILES`` entry, at its block's width or a quarter narrower (which rounds up to
    the same block), tiles ``M`` rows one row a tile with the entry's warps and no more
    programs than it measured: every row in exactly one program's walk, none past the last."""
    (kind, block), (warps, programs) = entry, KK.TILES[entry]
    c = block - narrower * (block // 4)  # a width that rounds up to the same block
    producer = {"cat": "identity", "gelu_backward": "gelu_backward:none", "gelu": "gelu:tanh"}.get(kind, kind)
    t = K.tiling(m, c, producer, pieces=3 if kind == "cat" else 1)
    assert (t.rows, t.block, t.num_warps) == (1, block, warps)
    assert t.programs <= programs and (t.programs - 1) * t.iters < m <= t.programs * t.iters


@needs_triton
@KERNEL
@given(st.integers(1, 40), st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_identity_producer_casts_the_rows_it_reads(m, n, seed):
    """``rowwise_fp8``'s launch: the rows as given, cast with their column sums."""
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 5
    t = K.tiling(m, n)
    q, inv = torch.full((m, n), float("nan")), torch.full((m, 1), float("nan"))
    part, amax_part = torch.full((t.programs, n), float("nan")), torch.zeros(1 + seed % 3, n)
    K.launch([x], None, None, q, inv, part, "identity", t, amax_part)
    _, inv_ref, colsum_ref, colamax_ref = K.rowwise_fp8_reference(x, column_amax=True)
    assert rel(inv, inv_ref) < 1e-5 and rel(part.sum(0), colsum_ref) < 1e-5
    assert torch.equal(amax_part.amax(0), colamax_ref)
    assert rel(q, (x / inv_ref).clamp(-448, 448)) < 1e-5


@needs_triton
def test_the_rowwise_fp8_op_on_3d_inputs_launches_the_kernel():
    """The op flattens ``[B, T, N]`` to rows (its FP8 bytes: see the module docstring)."""
    x = torch.randn(4, 6, 32)
    q, inv, colsum, colamax = K.rowwise_fp8(x, True)
    assert q.shape == (24, 32) and q.dtype == torch.float8_e4m3fn and inv.shape == (24, 1) and colsum.shape == (32,)
    _, inv_ref, colsum_ref, colamax_ref = K.rowwise_fp8_reference(x, True)
    assert rel(inv, inv_ref) < 1e-5 and rel(colsum, colsum_ref) < 1e-5 and torch.equal(colamax, colamax_ref)


@needs_triton
@KERNEL
@given(st.integers(1, 40), st.integers(1, 300), st.sampled_from(K.APPROXIMATIONS), st.integers(0, 2**31 - 1))
def test_gelu_producer_writes_the_activation_and_its_cast(m, n, approximate, seed):
    """``gelu_fp8``'s launch: ``a = gelu(h)`` written, cast row by row, its column maxima,
    no column sums."""
    h = torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 3
    t = K.tiling(m, n, "gelu")
    a, q, inv = (torch.full(s, float("nan")) for s in ((m, n), (m, n), (m, 1)))
    amax_part = torch.zeros(1 + seed % 3, n)
    K.launch([h], None, a, q, inv, None, f"gelu:{approximate}", t, amax_part)
    a_ref, _, inv_ref, _ = K.gelu_fp8_reference(h, approximate)
    assert rel(a, a_ref) < 1e-5 and rel(inv, inv_ref) < 1e-5
    assert rel(q, (a_ref / inv_ref).clamp(-448, 448)) < 1e-5
    assert torch.equal(amax_part.amax(0), a.abs().amax(0))


@needs_triton
@KERNEL
@given(
    st.integers(1, 40), st.integers(1, 100), st.sampled_from([2, 3]), st.sampled_from([None, 1, 3]),
    st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_concatenation_reads_strided_pieces_in_place(m, c, pieces, iters, rows, seed):
    """A concatenation of pieces that are transposed views (as attention's gradients come):
    the kernel reads each through its row stride and writes ``cat``, its cast, scales and
    column sums; one row all zeros in every piece gets a finite scale."""
    g_ = torch.Generator().manual_seed(seed)
    scales = torch.arange(1.0, pieces + 1).view(-1, 1, 1, 1)
    heads = torch.randn(pieces, m, 2, c, generator=g_) * scales  # per piece [M, H=2, C]: one head each
    xs = [heads[i, :, 0, :] for i in range(pieces)]  # [M, C] views, row stride 2C
    xs[-1] = torch.randn(m, 2 * c + 1, generator=g_)[:, :c]  # a row stride past its width, not a multiple
    for x in xs:
        x[0] = 0.0
    views = [K._rows_of(x) for x in xs]
    assert all(v.data_ptr() == x.data_ptr() for v, x in zip(views, xs))  # read in place, not copied
    t = RowTiling(m, c, rows=rows, iters=iters)
    n = c * pieces
    g, q, inv, part = (torch.full(s, float("nan")) for s in ((m, n), (m, n), (m, 1), (t.programs, n)))
    amax_part = torch.zeros(1 + seed % 3, n)
    K.launch(views, None, g, q, inv, part, "identity", t, amax_part)
    g_ref, _, inv_ref, colsum_ref, colamax_ref = K.cat_rowwise_fp8_reference(xs, column_amax=True)
    assert torch.equal(g, g_ref) and rel(inv, inv_ref) < 1e-5 and rel(part.sum(0), colsum_ref) < 1e-5
    assert torch.equal(amax_part.amax(0), colamax_ref)  # each piece's maxima in its own columns
    assert rel(q, (g_ref / inv_ref).clamp(-448, 448)) < 1e-5 and not q[0].any()


@needs_triton
def test_the_gelu_and_cat_ops_on_3d_inputs_launch_the_kernel():
    """The registered ops flatten ``[B, T, N]`` to rows; the cat's pieces may be views."""
    h = torch.randn(3, 7, 48) * 2
    a, q, inv, colamax = K.gelu_fp8(h, "tanh", True)
    assert a.shape == h.shape and q.shape == (21, 48) and q.dtype == torch.float8_e4m3fn and inv.shape == (21, 1)
    assert rel(a, K.gelu_fp8_reference(h, "tanh")[0]) < 1e-5 and torch.equal(colamax, a.reshape(21, 48).abs().amax(0))
    heads = [torch.randn(3, 2, 7, 8) for _ in range(3)]  # [B, H, T, D] viewed as [B, T, H * D]
    xs = [x.transpose(1, 2).reshape(3, 7, 16) for x in heads]
    g, q, inv, colsum, colamax = K.cat_rowwise_fp8(xs, True)
    g_ref, _, inv_ref, colsum_ref, colamax_ref = K.cat_rowwise_fp8_reference(xs, True)
    assert g.shape == (3, 7, 48) and q.shape == (21, 48) and colsum.shape == (48,)
    assert torch.equal(g, g_ref) and rel(inv, inv_ref) < 1e-5 and rel(colsum, colsum_ref) < 1e-5
    assert torch.equal(colamax, colamax_ref)


@pytest.mark.parametrize("column_amax", [False, True])
def test_fake_shapes_of_the_other_ops_match_the_real_ops(column_amax):
    from torch._subclasses.fake_tensor import FakeTensorMode

    h, xs = torch.randn(2, 5, 32), [torch.randn(2, 5, 8) for _ in range(3)]
    real = [K.gelu_fp8(h, "none", column_amax), K.cat_rowwise_fp8(xs, column_amax), K.rowwise_fp8(h, column_amax)]
    with FakeTensorMode() as mode:
        fh, fxs = mode.from_tensor(h), [mode.from_tensor(x) for x in xs]
        fake = [
            K.gelu_fp8(fh, "none", column_amax),
            K.cat_rowwise_fp8(fxs, column_amax),
            K.rowwise_fp8(fh, column_amax),
        ]
    for r, f in zip(real, fake):
        assert [(t.shape, t.dtype) for t in f] == [(t.shape, t.dtype) for t in r]
