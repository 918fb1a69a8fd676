"""The Triton kernel behind ``kernels/fp8/cast.py``'s and ``kernels/fp8/gated.py``'s ops: rows
produced from what it reads (as read, a GELU, a GELU gradient, a gated MLP's product or
gradient, or the pieces of a concatenation), cast row by row to
``float8_e4m3fn`` with their inverse scales, optionally written in the compute dtype, summed
along the columns and reduced to the column maxima of their magnitudes (a transposed cast's
scales), in one read of the inputs; its tiling, measured on the H200.

Shape legend: M rows (tokens), N the row width (the contracted dim of the matmul that reads the
FP8 copy), C the width of one piece of a concatenation.
"""

from __future__ import annotations

import math

import torch

from fsg._src.kernels._common import RowTiling, tl, triton

E4M3 = torch.float8_e4m3fn
EPS = 1e-12  # the smallest amax a scale is computed from (the float8 pass's casts use it too)
APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _gelu_grad(h, TANH: tl.constexpr):
    """``gelu'(h)`` in float32, as aten's ``gelu_backward`` computes it."""
    if TANH:
        beta = 0.7978845608028654  # sqrt(2 / pi)
        kappa = 0.044715
        inner = beta * (h + kappa * h * h * h)
        t = _tanh(inner)
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * beta * (1.0 + 3.0 * kappa * h * h)
    cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
    pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327  # 1 / sqrt(2 pi)
    return cdf + h * pdf


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: tanh to a few ulps at every x, no overflow
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _gelu(h, TANH: tl.constexpr):
    """``gelu(h)`` in float32, as aten's ``gelu`` computes it."""
    if TANH:
        return 0.5 * h * (1.0 + _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h)))
    return 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))


@triton.jit
def _sigmoid(h):
    return 1.0 / (1.0 + tl.exp(-h))


@triton.jit
def _act(x, ACT: tl.constexpr):
    """A gated MLP's activation in float32: SiLU (``ACT`` 0), GELU (1: erf, 2: tanh)."""
    if ACT == 0:
        return x * _sigmoid(x)
    return _gelu(x, ACT == 2)


@triton.jit
def _act_grad(h, ACT: tl.constexpr):
    """The derivative of ``_act`` at ``h``, as aten's ``silu_backward``/``gelu_backward`` computes it."""
    if ACT == 0:
        s = _sigmoid(h)
        return s * (1.0 + h * (1.0 - s))
    return _gelu_grad(h, ACT == 2)


# The activations of a gated MLP's producers (``kernels/fp8/gated.py``), by name: ``ACT`` above.
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
# What computes the rows the kernel casts from what it reads (x; h and y where named): the rows
# as read (also the pieces of a concatenation), gelu'(h) * x for each of gelu_backward's
# `approximate` forms, gelu(x) for each of gelu's; and for a gated MLP (each activation), its
# product act(x) * h ("gated:<act>"), act'(h) * x ("gated_backward:silu"; a GELU's is above)
# and act'(h) * (x * y) ("gated_backward_mul:<act>"). A product's first factor is rounded to
# the dtype before it is used (act(x), x * y), as aten's two ops round it.
PRODUCERS = {
    "identity": 0, "gelu_backward:none": 1, "gelu_backward:tanh": 2, "gelu:none": 3, "gelu:tanh": 4,
    **{f"gated:{a}": 5 + i for a, i in ACTIVATIONS.items()}, "gated_backward:silu": 8,
    **{f"gated_backward_mul:{a}": 9 + i for a, i in ACTIVATIONS.items()},
}  # fmt: skip


@triton.jit
def _produce(
    x_ptr, h_ptr, y_ptr, g_ptr, rows, row_ok, cols, C, stride, N, col0, PRODUCER: tl.constexpr, WRITE_G: tl.constexpr
):
    """One piece's ``[ROWS, BLOCK]`` tile of the rows ``g`` in float32 (0 where masked):
    produced from ``x`` (row stride ``stride``, ``C`` wide; ``h`` and ``y`` with its strides),
    stored to ``g`` at columns ``col0 + cols`` of its ``N``-wide rows when ``WRITE_G``, as the
    rounded values there."""
    mask = row_ok[:, None] & (cols < C)[None, :]
    offs = rows[:, None] * stride + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dtype = g_ptr.dtype.element_ty
    if PRODUCER == 0:
        g = x
    elif PRODUCER <= 2:
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = (x.to(tl.float32) * _gelu_grad(h, PRODUCER == 2)).to(dtype)
    elif PRODUCER <= 4:
        g = _gelu(x.to(tl.float32), PRODUCER == 4).to(dtype)
    elif PRODUCER <= 7:  # act(x) * h
        a = _act(x.to(tl.float32), PRODUCER - 5).to(dtype).to(tl.float32)
        g = (a * tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    else:  # act'(h) * x, or act'(h) * (x * y)
        dy = x.to(tl.float32)
        if PRODUCER >= 9:
            dy = (dy * tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = (dy * _act_grad(h, 0 if PRODUCER <= 9 else PRODUCER - 9)).to(dtype)
    if WRITE_G:
        tl.store(g_ptr + rows[:, None] * N + col0 + cols[None, :], g, mask=mask)
    return tl.where(mask, g.to(tl.float32), 0.0)  # what the readers of g see: its rounded values


@triton.jit
def scale_of(amax, eps, fp8_max):
    """``fp8_max / max(amax, eps)`` in float32, as the graph computes it (a reciprocal, then a
    product): every FP8 cast kernel's scales."""
    return (1.0 / tl.maximum(amax, eps)) * fp8_max


@triton.jit
def saturate(g, scale, fp8_max):
    """``g * scale`` clamped to the FP8 range (``scale`` already broadcast to ``g``)."""
    return tl.minimum(tl.maximum(g * scale, -fp8_max), fp8_max)


@triton.jit
def _store_fp8(q_ptr, g, scale, rows, row_ok, cols, C, N, col0, fp8_max):
    q = saturate(g, scale[:, None], fp8_max)
    mask = row_ok[:, None] & (cols < C)[None, :]
    tl.store(q_ptr + rows[:, None] * N + col0 + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rowwise_fp8_kernel(
    x0_ptr, x1_ptr, x2_ptr, h_ptr, y_ptr, g_ptr, q_ptr, inv_ptr, colsum_part_ptr, colamax_part_ptr, amax_rows, M, C,
    s0, s1, s2, fp8_max, eps, PRODUCER: tl.constexpr, PIECES: tl.constexpr, WRITE_G: tl.constexpr, COLSUM: tl.constexpr,
    COLAMAX: tl.constexpr, ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = True,
    STAGES: tl.constexpr = 1,
):  # fmt: skip
    """Rows ``g``, the concatenation of ``PIECES`` pieces ``C`` wide (each from ``x_i``, row
    stride ``s_i``), produced and, when ``QUANT``, cast row by row to FP8 with their inverse
    scales; ``g`` itself stored when ``WRITE_G``; one float32 row of column sums per program
    when ``COLSUM``; the column maxima of ``|g|`` folded into ``amax_rows`` zeroed rows when
    ``COLAMAX``."""
    pid = tl.program_id(0)
    N = C * PIECES
    cols = tl.arange(0, BLOCK)
    colsum0 = tl.zeros([BLOCK], tl.float32)
    colsum1 = tl.zeros([BLOCK], tl.float32)
    colsum2 = tl.zeros([BLOCK], tl.float32)
    colamax0 = tl.zeros([BLOCK], tl.float32)
    colamax1 = tl.zeros([BLOCK], tl.float32)
    colamax2 = tl.zeros([BLOCK], tl.float32)
    for it in tl.range(ITERS, num_stages=STAGES):  # STAGES > 1: the next rows' loads in flight
        rows = ((pid * ITERS + it) * ROWS).to(tl.int64) + tl.arange(0, ROWS)
        row_ok = rows < M
        g0 = _produce(x0_ptr, h_ptr, y_ptr, g_ptr, rows, row_ok, cols, C, s0, N, 0, PRODUCER, WRITE_G)
        amax = tl.max(tl.abs(g0), axis=1)
        if PIECES > 1:
            g1 = _produce(x1_ptr, h_ptr, y_ptr, g_ptr, rows, row_ok, cols, C, s1, N, C, PRODUCER, WRITE_G)
            amax = tl.maximum(amax, tl.max(tl.abs(g1), axis=1))
        if PIECES > 2:
            g2 = _produce(x2_ptr, h_ptr, y_ptr, g_ptr, rows, row_ok, cols, C, s2, N, 2 * C, PRODUCER, WRITE_G)
            amax = tl.maximum(amax, tl.max(tl.abs(g2), axis=1))
        scale = scale_of(amax, eps, fp8_max)
        if QUANT:
            tl.store(inv_ptr + rows, 1.0 / scale, mask=row_ok)
            _store_fp8(q_ptr, g0, scale, rows, row_ok, cols, C, N, 0, fp8_max)
        if COLSUM:
            colsum0 += tl.sum(g0, axis=0)
        if COLAMAX:  # (masked elements are 0: they leave a maximum of |g| as it is)
            colamax0 = tl.maximum(colamax0, tl.max(tl.abs(g0), axis=0))
        if PIECES > 1:
            if QUANT:
                _store_fp8(q_ptr, g1, scale, rows, row_ok, cols, C, N, C, fp8_max)
            if COLSUM:
                colsum1 += tl.sum(g1, axis=0)
            if COLAMAX:
                colamax1 = tl.maximum(colamax1, tl.max(tl.abs(g1), axis=0))
        if PIECES > 2:
            if QUANT:
                _store_fp8(q_ptr, g2, scale, rows, row_ok, cols, C, N, 2 * C, fp8_max)
            if COLSUM:
                colsum2 += tl.sum(g2, axis=0)
            if COLAMAX:
                colamax2 = tl.maximum(colamax2, tl.max(tl.abs(g2), axis=0))
    if COLSUM:
        _store_partials(colsum_part_ptr, colsum0, colsum1, colsum2, pid, N, C, cols, PIECES)
    if COLAMAX:  # into row pid % amax_rows of a small zeroed buffer that stays in L2 (max: any order)
        _max_partials(colamax_part_ptr, colamax0, colamax1, colamax2, pid % amax_rows, N, C, cols, PIECES)


@triton.jit
def _max_partials(part_ptr, p0, p1, p2, row, N, C, cols, PIECES: tl.constexpr):
    """A program's column maxima (each >= 0) folded into row ``row`` of the partials by atomic max."""
    tl.atomic_max(part_ptr + row * N + cols, p0, mask=cols < C, sem="relaxed")
    if PIECES > 1:
        tl.atomic_max(part_ptr + row * N + C + cols, p1, mask=cols < C, sem="relaxed")
    if PIECES > 2:
        tl.atomic_max(part_ptr + row * N + 2 * C + cols, p2, mask=cols < C, sem="relaxed")


@triton.jit
def _store_partials(part_ptr, p0, p1, p2, pid, N, C, cols, PIECES: tl.constexpr):
    """A program's row of column partials (each piece's ``C`` columns in place)."""
    tl.store(part_ptr + pid * N + cols, p0, mask=cols < C)
    if PIECES > 1:
        tl.store(part_ptr + pid * N + C + cols, p1, mask=cols < C)
    if PIECES > 2:
        tl.store(part_ptr + pid * N + 2 * C + cols, p2, mask=cols < C)


def tiling(M: int, C: int, producer: str = "identity", pieces: int = 1) -> RowTiling:
    """One row a tile (``C``-wide pieces), and the warps and program count ``TILES`` holds for
    the producer and the width (measured best on the H200), else ``block / 512`` warps (4 to
    16) and ``PROGRAMS`` programs walking the rows.

    From the H200 sweeps (``benchmarks/fp8_cast.py --sweep [--wide]``, figures in
    benchmarks/RESULTS.md): tiles of 2 or 4 rows were slower than one row at every width from
    1024 to 8192; the best warps differ by producer and width; 1024-2048 programs beat 512 and
    one program a row."""
    block = triton.next_power_of_2(C)
    kind = producer.split(":")[0] if pieces == 1 else "cat"
    warps, programs = TILES.get((kind, block), (min(16, max(4, block // 512)), PROGRAMS))
    return RowTiling(M, C, rows=1, iters=max(1, math.ceil(M / programs)), num_warps=warps)


# rows of the column-maxima buffer the programs fold into by atomic max: small enough to stay
# in L2 (32 x 8192 floats: 1 MiB), so the maxima cost no DRAM traffic and one tiny reduction
AMAX_ROWS = 32
PROGRAMS = 2048  # programs over the rows (and column-sum partial rows): ~16 per SM on an H200
# (producer, block) -> (num_warps, programs), the best of the H200 sweeps at M = 16384 where
# it differs from the default: GPT-2 355M's widths (4096 for the MLP, 1024 for the rest) and
# the 1.3B config's (8192, 2048; "cat" is the qkv gradient's three pieces)
TILES: dict[tuple[str, int], tuple[int, int]] = {
    ("gelu", 4096): (16, PROGRAMS),
    ("identity", 1024): (8, PROGRAMS),
    ("gelu", 8192): (32, PROGRAMS),
    ("gelu_backward", 8192): (8, 1024),
    ("cat", 2048): (8, 1024),
    ("identity", 2048): (4, 1024),
}


def launch(
    xs: list[torch.Tensor], h_MC, g_MN, q_MN, inv_M, colsum_part_PN, producer: str,
    t: RowTiling | None = None, colamax_part_PN: torch.Tensor | None = None, y_MC: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Writes into the given outputs. ``xs``: the pieces, each ``[M, C]`` with unit column
    stride (one unless ``producer`` is ``"identity"``); ``h_MC`` the second input of a
    ``"gelu_backward:*"`` or ``"gated*"`` producer (the activation's input of a gradient, the
    second factor of a ``"gated:*"`` product; ``x``'s strides), else ``None``; ``y_MC`` the
    second factor of a ``"gated_backward_mul:*"`` producer's gradient (``x``'s strides), else ``None``; ``g_MN``
    ``None`` where the rows are not written (``"identity"`` with one piece);
    ``colsum_part_PN`` ``None`` for no column sums, else ``t.programs`` rows whose sum is the
    column sums; ``colamax_part_PN`` ``None``, or zeroed rows (any number: ``AMAX_ROWS``) whose
    maximum becomes the column maxima of ``|g|``. ``q_MN`` is scaled for ``float8_e4m3fn``
    whatever its dtype (the CPU tests pass float32: see their docstring); ``q_MN`` and
    ``inv_M`` ``None`` for no cast at all (the rows and their column sums only)."""
    M, C = xs[0].shape
    assert len(xs) <= 3 and all(x.shape == (M, C) and (x.stride(1) == 1 or C <= 1) for x in xs), "pieces [M, C]"
    assert all(v is None or v.stride() == xs[0].stride() for v in (h_MC, y_MC))
    t = t or tiling(M, C, producer, len(xs))
    quant = q_MN is not None
    strides = [x.stride(0) for x in xs] + [0] * (3 - len(xs))
    x0 = xs[0]
    q_MN, inv_M = (x0, x0) if q_MN is None else (q_MN, inv_M)  # unused where not QUANT
    _rowwise_fp8_kernel[(t.programs,)](
        x0, *(xs[i] if i < len(xs) else x0 for i in (1, 2)), *(x0 if v is None else v for v in (h_MC, y_MC, g_MN)),
        q_MN, inv_M, *(q_MN if p is None else p for p in (colsum_part_PN, colamax_part_PN)),
        1 if colamax_part_PN is None else colamax_part_PN.shape[0], M, C, *strides,
        float(torch.finfo(E4M3).max), EPS,
        PRODUCER=PRODUCERS[producer], PIECES=len(xs), WRITE_G=g_MN is not None,
        COLSUM=colsum_part_PN is not None, COLAMAX=colamax_part_PN is not None,
        ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, QUANT=quant, STAGES=t.stages, num_warps=t.num_warps,
    )  # fmt: skip
