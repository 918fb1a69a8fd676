"""Fused FP8 casts for the float8 pass (``passes/float8.py``): a tensor's rowwise FP8 copy
(and, where a bias gradient sums it, its column sums) in one read, computed in the kernel
that produces the tensor where that producer is an elementwise op of the MLP or a
concatenation.

Shape legend: M rows (tokens), N the row width (the contracted dim of the matmul that reads the
FP8 copy), C the width of one piece of a concatenation.

Left to Inductor, each cast is a row reduction (the amax) fused with the tensor's producer,
and the producer is computed again for the writes (benchmarks/RESULTS.md: 226 us a layer for
the MLP's GELU gradient at GPT-2 355M on the H200, where its bytes need ~100). One kernel,
``_rowwise_fp8_kernel``, does each case in one read of its inputs:

- ``gelu_backward_fp8``: the MLP's up-projection gradient ``g = dy * gelu'(h)``, read by the
  grad-input matmul (FP8, a scale per row), the grad-weight matmul (``g`` in bfloat16) and the
  bias gradient (``g``'s column sums): writes ``g``, its FP8 copy and inverse scales, and
  float32 column-sum partials (``PROGRAMS`` rows at most, summed by one torch reduction).
- ``gelu_fp8``: the MLP's activation ``a = gelu(h)``, read by the down-projection (FP8) and
  its grad-weight (bfloat16): writes ``a``, its FP8 copy and scales.
- ``cat_rowwise_fp8``: a fused qkv projection's gradient, ``cat([dq, dk, dv], -1)``, whose
  pieces come transposed out of attention's backward: reads each piece in place and writes
  the concatenation, its FP8 copy, scales and column sums.
- ``rowwise_fp8``: the cast and column sums of a tensor already written (off by default in
  the pass: measured slower where Inductor fuses the cast into a layer norm's backward).

The quantities equal the unfused graph's (``Quantizer.rowwise_operand``): the row maxima and
the column sums are of the rows rounded to their dtype, ``scale = fp8_max / max(amax, eps)``,
``q = saturate(g * scale)``, and ``_scaled_mm`` takes ``1 / scale``.
"""

from __future__ import annotations

import math

import torch

from fsg._src.kernels._common import RowTiling, tl, triton, use_triton

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


# What computes the rows the kernel casts from what it reads (x, and h for a GELU gradient):
# the rows as read (also the pieces of a concatenation), gelu'(h) * x for each of
# gelu_backward's `approximate` forms, or gelu(x) for each of gelu's.
PRODUCERS = {"identity": 0, "gelu_backward:none": 1, "gelu_backward:tanh": 2, "gelu:none": 3, "gelu:tanh": 4}


@triton.jit
def _produce(
    x_ptr, h_ptr, g_ptr, rows, row_ok, cols, C, stride, N, col0, PRODUCER: tl.constexpr, WRITE_G: tl.constexpr
):
    """One piece's ``[ROWS, BLOCK]`` tile of the rows ``g`` in float32 (0 where masked):
    produced from ``x`` (row stride ``stride``, ``C`` wide), stored to ``g`` at columns
    ``col0 + cols`` of its ``N``-wide rows when ``WRITE_G``, as the rounded values there."""
    mask = row_ok[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    if PRODUCER == 0:
        g = x
    elif PRODUCER <= 2:
        h = tl.load(h_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = (x.to(tl.float32) * _gelu_grad(h, PRODUCER == 2)).to(g_ptr.dtype.element_ty)
    else:
        g = _gelu(x.to(tl.float32), PRODUCER == 4).to(g_ptr.dtype.element_ty)
    if WRITE_G:
        tl.store(g_ptr + rows[:, None] * N + col0 + cols[None, :], g, mask=mask)
    return tl.where(mask, g.to(tl.float32), 0.0)  # what the readers of g see: its rounded values


@triton.jit
def _store_fp8(q_ptr, g, scale, rows, row_ok, cols, C, N, col0, fp8_max):
    q = tl.minimum(tl.maximum(g * scale[:, None], -fp8_max), fp8_max)
    mask = row_ok[:, None] & (cols < C)[None, :]
    tl.store(q_ptr + rows[:, None] * N + col0 + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rowwise_fp8_kernel(
    x0_ptr, x1_ptr, x2_ptr, h_ptr, g_ptr, q_ptr, inv_ptr, colsum_part_ptr, M, C, s0, s1, s2, fp8_max, eps,
    PRODUCER: tl.constexpr, PIECES: tl.constexpr, WRITE_G: tl.constexpr, COLSUM: tl.constexpr,
    ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Rows ``g``, the concatenation of ``PIECES`` pieces ``C`` wide (each from ``x_i``, row
    stride ``s_i``), produced and cast row by row to FP8 with their inverse scales; ``g``
    itself stored when ``WRITE_G``; one float32 row of column sums per program when
    ``COLSUM``."""
    pid = tl.program_id(0)
    N = C * PIECES
    cols = tl.arange(0, BLOCK)
    colsum0 = tl.zeros([BLOCK], tl.float32)
    colsum1 = tl.zeros([BLOCK], tl.float32)
    colsum2 = tl.zeros([BLOCK], tl.float32)
    for it in range(ITERS):
        rows = ((pid * ITERS + it) * ROWS).to(tl.int64) + tl.arange(0, ROWS)
        row_ok = rows < M
        g0 = _produce(x0_ptr, h_ptr, g_ptr, rows, row_ok, cols, C, s0, N, 0, PRODUCER, WRITE_G)
        amax = tl.max(tl.abs(g0), axis=1)
        if PIECES > 1:
            g1 = _produce(x1_ptr, h_ptr, g_ptr, rows, row_ok, cols, C, s1, N, C, PRODUCER, WRITE_G)
            amax = tl.maximum(amax, tl.max(tl.abs(g1), axis=1))
        if PIECES > 2:
            g2 = _produce(x2_ptr, h_ptr, g_ptr, rows, row_ok, cols, C, s2, N, 2 * C, PRODUCER, WRITE_G)
            amax = tl.maximum(amax, tl.max(tl.abs(g2), axis=1))
        scale = (1.0 / tl.maximum(amax, eps)) * fp8_max
        tl.store(inv_ptr + rows, 1.0 / scale, mask=row_ok)
        _store_fp8(q_ptr, g0, scale, rows, row_ok, cols, C, N, 0, fp8_max)
        if COLSUM:
            colsum0 += tl.sum(g0, axis=0)
        if PIECES > 1:
            _store_fp8(q_ptr, g1, scale, rows, row_ok, cols, C, N, C, fp8_max)
            if COLSUM:
                colsum1 += tl.sum(g1, axis=0)
        if PIECES > 2:
            _store_fp8(q_ptr, g2, scale, rows, row_ok, cols, C, N, 2 * C, fp8_max)
            if COLSUM:
                colsum2 += tl.sum(g2, axis=0)
    if COLSUM:
        tl.store(colsum_part_ptr + pid * N + cols, colsum0, mask=cols < C)
        if PIECES > 1:
            tl.store(colsum_part_ptr + pid * N + C + cols, colsum1, mask=cols < C)
        if PIECES > 2:
            tl.store(colsum_part_ptr + pid * N + 2 * C + cols, colsum2, mask=cols < C)


def tiling(M: int, C: int, producer: str = "identity", pieces: int = 1) -> RowTiling:
    """One row a tile (``C``-wide pieces), ``PROGRAMS`` programs walking the rows, and the
    warps ``WARPS`` measured best for the producer and the width.

    The H200 sweep (``benchmarks/fp8_cast.py --sweep``, GPT-2 355M's tensors, RESULTS.md):
    tiles of 2 or 4 rows ran 1.5-10x slower than one row at every width; about 2048 programs
    beat 512 by up to 1.3x (the residual gradient 0.037 against 0.048 ms) and matched one
    program a row; the best warps differ by producer (a GELU 16, its gradient 8)."""
    block = triton.next_power_of_2(C)
    kind = producer.split(":")[0] if pieces == 1 else "cat"
    warps = WARPS.get((kind, block), min(16, max(4, block // 512)))
    return RowTiling(M, C, rows=1, iters=max(1, math.ceil(M / PROGRAMS)), num_warps=warps)


PROGRAMS = 2048  # programs over the rows (and column-sum partial rows): ~16 per SM on an H200
# (producer, block) -> num_warps, the best of the H200 sweep where it differs from the default
# rule (block / 512, 4 to 16): GPT-2 355M's widths (4096 for the MLP, 1024 for the rest)
WARPS: dict[tuple[str, int], int] = {("gelu", 4096): 16, ("identity", 1024): 8}


def launch(
    xs: list[torch.Tensor], h_MC, g_MN, q_MN, inv_M, colsum_part_PN, producer: str,
    t: RowTiling | None = None,
) -> None:  # fmt: skip
    """Writes into the given outputs. ``xs``: the pieces, each ``[M, C]`` with unit column
    stride (one unless ``producer`` is ``"identity"``); ``h_MC`` the GELU input of a
    ``"gelu_backward:*"`` producer (``x``'s strides), else ``None``; ``g_MN`` ``None`` where
    the rows are not written (``"identity"`` with one piece); ``colsum_part_PN`` ``None``
    for no column sums, else ``t.programs`` rows whose sum is the column sums. ``q_MN`` is
    scaled for ``float8_e4m3fn`` whatever its dtype (the CPU tests pass float32: see their
    docstring)."""
    M, C = xs[0].shape
    assert len(xs) <= 3 and all(x.shape == (M, C) and (x.stride(1) == 1 or C <= 1) for x in xs), "pieces [M, C]"
    assert h_MC is None or h_MC.stride() == xs[0].stride()
    colsum = colsum_part_PN is not None
    t = t or tiling(M, C, producer, len(xs))
    strides = [x.stride(0) for x in xs] + [0] * (3 - len(xs))
    x0 = xs[0]
    _rowwise_fp8_kernel[(t.programs,)](
        x0, *(xs[i] if i < len(xs) else x0 for i in (1, 2)), x0 if h_MC is None else h_MC, x0 if g_MN is None else g_MN,
        q_MN, inv_M, q_MN if colsum_part_PN is None else colsum_part_PN, M, C, *strides,
        float(torch.finfo(E4M3).max), EPS,
        PRODUCER=PRODUCERS[producer], PIECES=len(xs), WRITE_G=g_MN is not None, COLSUM=colsum,
        ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, num_warps=t.num_warps,
    )  # fmt: skip


def rowwise_fp8_reference(g, fp8_dtype: torch.dtype = E4M3):
    """``(q_MN, inv_M1, colsum_N)`` of ``g``'s rows in plain torch: the unfused graph's ops."""
    g_MN = g.reshape(-1, g.shape[-1]).float()
    fp8_max = torch.finfo(fp8_dtype).max
    scale = g_MN.abs().amax(1, keepdim=True).clamp_min(EPS).reciprocal() * fp8_max
    q = (g_MN * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q, scale.reciprocal(), g_MN.sum(0)


def gelu_backward_fp8_reference(dy, h, approximate: str, fp8_dtype: torch.dtype = E4M3):
    """``(g, q_MN, inv_M1, colsum_N)`` in plain torch: the unfused graph's ops."""
    g = torch.ops.aten.gelu_backward.default(dy, h, approximate=approximate)
    return (g, *rowwise_fp8_reference(g, fp8_dtype))


def gelu_fp8_reference(h, approximate: str, fp8_dtype: torch.dtype = E4M3):
    """``(a, q_MN, inv_M1)`` in plain torch: the unfused graph's ops."""
    a = torch.ops.aten.gelu.default(h, approximate=approximate)
    return (a, *rowwise_fp8_reference(a, fp8_dtype)[:2])


def cat_rowwise_fp8_reference(xs, fp8_dtype: torch.dtype = E4M3):
    """``(g, q_MN, inv_M1, colsum_N)`` of ``g = cat(xs, -1)`` in plain torch."""
    g = torch.cat(xs, -1)
    return (g, *rowwise_fp8_reference(g, fp8_dtype))


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[M, C]`` rows with unit column stride: a view where its strides allow."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 or rows.shape[1] <= 1 else rows.contiguous()


def _outputs(M: int, N: int, device, t: RowTiling, colsum: bool):
    f32 = {"dtype": torch.float32, "device": device}
    q, inv = torch.empty((M, N), dtype=E4M3, device=device), torch.empty((M, 1), **f32)
    return q, inv, torch.empty((t.programs, N), **f32) if colsum else None


def _num_rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


@torch.library.custom_op("fsg::gelu_backward_fp8", mutates_args=())
def gelu_backward_fp8(
    dy: torch.Tensor, h: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.gelu_backward(dy, h, approximate)`` (shape ``[..., N]``), with the rowwise
    ``float8_e4m3fn`` copy of its ``[M, N]`` rows, their inverse scales ``[M, 1]`` and its
    float32 column sums ``[N]``."""
    if not use_triton(dy):
        return gelu_backward_fp8_reference(dy, h, approximate)
    N = dy.shape[-1]
    dy_MN, h_MN = dy.reshape(-1, N).contiguous(), h.reshape(-1, N).contiguous()
    t = tiling(dy_MN.shape[0], N, "gelu_backward")
    q_MN, inv_M1, part = _outputs(dy_MN.shape[0], N, dy.device, t, colsum=True)
    g_MN = torch.empty_like(dy_MN)
    launch([dy_MN], h_MN, g_MN, q_MN, inv_M1, part, f"gelu_backward:{approximate}", t)
    return g_MN.reshape(dy.shape), q_MN, inv_M1, part.sum(0)


@torch.library.custom_op("fsg::gelu_fp8", mutates_args=())
def gelu_fp8(h: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.gelu(h, approximate)`` (shape ``[..., N]``), with the rowwise ``float8_e4m3fn``
    copy of its ``[M, N]`` rows and their inverse scales ``[M, 1]``, in one read of ``h``."""
    if not use_triton(h):
        return gelu_fp8_reference(h, approximate)
    h_MN = _rows_of(h)
    M, N = h_MN.shape
    t = tiling(M, N, "gelu")
    q_MN, inv_M1, _ = _outputs(M, N, h.device, t, colsum=False)
    a_MN = torch.empty((M, N), dtype=h.dtype, device=h.device)
    launch([h_MN], None, a_MN, q_MN, inv_M1, None, f"gelu:{approximate}", t)
    return a_MN.reshape(h.shape), q_MN, inv_M1


@torch.library.custom_op("fsg::rowwise_fp8", mutates_args=())
def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rowwise ``float8_e4m3fn`` copy of ``x``'s ``[M, N]`` rows, their inverse scales
    ``[M, 1]`` and ``x``'s float32 column sums ``[N]``, in one read of ``x``."""
    if not use_triton(x):
        return rowwise_fp8_reference(x)
    x_MN = _rows_of(x)
    t = tiling(*x_MN.shape)
    q_MN, inv_M1, part = _outputs(*x_MN.shape, x.device, t, colsum=True)
    launch([x_MN], None, None, q_MN, inv_M1, part, "identity", t)
    return q_MN, inv_M1, part.sum(0)


@torch.library.custom_op("fsg::cat_rowwise_fp8", mutates_args=())
def cat_rowwise_fp8(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g = cat(xs, -1)`` of two or three pieces of one shape ``[..., C]`` (contiguous), with
    the rowwise ``float8_e4m3fn`` copy of its ``[M, N]`` rows, their inverse scales ``[M, 1]``
    and its float32 column sums ``[N]``, reading each piece once (strided pieces too: an
    attention gradient's transposed heads)."""
    if not use_triton(xs[0]):
        return cat_rowwise_fp8_reference(xs)
    pieces = [_rows_of(x) for x in xs]
    (M, C), N = pieces[0].shape, xs[0].shape[-1] * len(xs)
    t = tiling(M, C, pieces=len(xs))
    q_MN, inv_M1, part = _outputs(M, N, xs[0].device, t, colsum=True)
    g_MN = torch.empty((M, N), dtype=xs[0].dtype, device=xs[0].device)
    launch(pieces, None, g_MN, q_MN, inv_M1, part, "identity", t)
    return g_MN.reshape(*xs[0].shape[:-1], N), q_MN, inv_M1, part.sum(0)


def _fake_rows(x: torch.Tensor, N: int | None = None, colsum: bool = True):
    N = x.shape[-1] if N is None else N
    M, f32 = _num_rows(x), {"dtype": torch.float32, "device": x.device}
    q, inv = torch.empty((M, N), dtype=E4M3, device=x.device), torch.empty((M, 1), **f32)
    return (q, inv, torch.empty((N,), **f32)) if colsum else (q, inv)


@rowwise_fp8.register_fake
def _(x):
    return _fake_rows(x)


@gelu_backward_fp8.register_fake
def _(dy, h, approximate):
    return (torch.empty(dy.shape, dtype=dy.dtype, device=dy.device), *_fake_rows(dy))  # g contiguous, as written


@gelu_fp8.register_fake
def _(h, approximate):
    return (torch.empty(h.shape, dtype=h.dtype, device=h.device), *_fake_rows(h, colsum=False))


@cat_rowwise_fp8.register_fake
def _(xs):
    N = xs[0].shape[-1] * len(xs)
    return (torch.empty((*xs[0].shape[:-1], N), dtype=xs[0].dtype, device=xs[0].device), *_fake_rows(xs[0], N))
