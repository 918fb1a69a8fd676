"""Fused FP8 casts for the float8 pass (``passes/float8.py``): a tensor's rowwise FP8 copy and
its column sums in one read, with the tensor's producer where that producer is a GELU gradient.

Shape legend: M rows (tokens), N the row width (the contracted dim of the matmul that reads the
FP8 copy).

``gelu_backward_fp8``: the MLP's up-projection gradient ``g = dy * gelu'(h)`` feeds three
readers under ``Float8(recipe="rowwise")``: the grad-input matmul (FP8, a scale per row of
``g``), the grad-weight matmul (``g`` in bfloat16) and the bias gradient (``g``'s column
sums). Left to Inductor that is a pointwise kernel writing ``g`` and a mixed-order reduction
that computes ``g`` again for the row maxima, the cast and the column sums (226 us a layer at
GPT-2 355M on the H200, benchmarks/RESULTS.md). This kernel reads ``dy`` and ``h`` once and
writes ``g``, its FP8 copy with one inverse scale per row, and float32 column-sum partials,
one row per program, which one torch reduction sums.

``rowwise_fp8``: the same cast and column sums of a tensor already written (a residual
stream's gradient, which feeds a grad-input matmul and a bias gradient); the pass uses it only
with ``float8_quantize.FUSE_COLUMN_SUMS`` (off until measured against Inductor's kernels).

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
_MAX_PROGRAMS = 512  # column-sum partial rows: about 4 per SM on an H200, few enough to sum cheaply
APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _gelu_grad(h, TANH: tl.constexpr):
    """``gelu'(h)`` in float32, as aten's ``gelu_backward`` computes it."""
    if TANH:
        beta = 0.7978845608028654  # sqrt(2 / pi)
        kappa = 0.044715
        inner = beta * (h + kappa * h * h * h)
        e = tl.exp(-2.0 * tl.abs(inner))  # in (0, 1]: tanh to a few ulps at every inner, no overflow
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(inner < 0, -t, t)
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * beta * (1.0 + 3.0 * kappa * h * h)
    cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
    pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327  # 1 / sqrt(2 pi)
    return cdf + h * pdf


# What computes the rows the kernel casts: read as they are, or a GELU gradient from dy and h.
PRODUCERS = {"identity": 0, "none": 1, "tanh": 2}  # the last two: gelu_backward's `approximate`


@triton.jit
def _rowwise_fp8_kernel(
    x_ptr, h_ptr, g_ptr, q_ptr, inv_ptr, colsum_part_ptr, M, N, fp8_max, eps,
    PRODUCER: tl.constexpr, ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Rows ``g`` (``x`` itself, or ``x * gelu'(h)`` stored to ``g_ptr``) cast row by row to
    FP8, their inverse scales, and one float32 row of column sums per program."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    colsum = tl.zeros([BLOCK], tl.float32)
    for it in range(ITERS):
        first = (pid * ITERS + it) * ROWS
        rows = first.to(tl.int64) + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < N)[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if PRODUCER == 0:
            g = x.to(tl.float32)
        else:
            h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = (x.to(tl.float32) * _gelu_grad(h, PRODUCER == 2)).to(g_ptr.dtype.element_ty)
            tl.store(g_ptr + offs, g, mask=mask)
            g = g.to(tl.float32)  # what the readers of g see: its rounded values
        g = tl.where(mask, g, 0.0)
        amax = tl.maximum(tl.max(tl.abs(g), axis=1), eps)
        scale = (1.0 / amax) * fp8_max
        q = tl.minimum(tl.maximum(g * scale[:, None], -fp8_max), fp8_max)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(inv_ptr + rows, 1.0 / scale, mask=row_ok)
        colsum += tl.sum(g, axis=0)
    tl.store(colsum_part_ptr + pid * N + cols, colsum, mask=cols < N)


def tiling(M: int, N: int) -> RowTiling:
    """Rows of one tile as ``RowTiling`` picks them; enough iterations that at most
    ``_MAX_PROGRAMS`` programs (column-sum partials) remain."""
    rows = RowTiling(M, N).rows
    return RowTiling(M, N, rows=rows, iters=max(1, math.ceil(M / (rows * _MAX_PROGRAMS))))


def launch(x_MN, h_MN, g_MN, q_MN, inv_M, colsum_part_PN, producer: str, t: RowTiling | None = None) -> None:
    """Writes into the given outputs (``h_MN`` and ``g_MN`` ``None`` for ``"identity"``);
    ``colsum_part_PN`` has ``t.programs`` rows (default tiling: ``tiling(M, N)``), whose sum is
    the column sums. ``q_MN`` is scaled for ``float8_e4m3fn`` whatever its dtype (the CPU
    tests pass float32: see their docstring)."""
    M, N = x_MN.shape
    t = t or tiling(M, N)
    _rowwise_fp8_kernel[(t.programs,)](
        x_MN, x_MN if h_MN is None else h_MN, x_MN if g_MN is None else g_MN, q_MN, inv_M, colsum_part_PN, M, N,
        float(torch.finfo(E4M3).max), EPS,
        PRODUCER=PRODUCERS[producer], ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, num_warps=t.num_warps,
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


def _outputs(x: torch.Tensor):
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    t = tiling(M, N)
    f32 = {"dtype": torch.float32, "device": x.device}
    q, inv = torch.empty((M, N), dtype=E4M3, device=x.device), torch.empty((M, 1), **f32)
    return t, q, inv, torch.empty((t.programs, N), **f32)


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
    t, q_MN, inv_M1, part = _outputs(dy)
    g_MN = torch.empty_like(dy_MN)
    launch(dy_MN, h_MN, g_MN, q_MN, inv_M1, part, approximate, t)
    return g_MN.reshape(dy.shape), q_MN, inv_M1, part.sum(0)


@torch.library.custom_op("fsg::rowwise_fp8", mutates_args=())
def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rowwise ``float8_e4m3fn`` copy of ``x``'s ``[M, N]`` rows, their inverse scales
    ``[M, 1]`` and ``x``'s float32 column sums ``[N]``, in one read of ``x``."""
    if not use_triton(x):
        return rowwise_fp8_reference(x)
    t, q_MN, inv_M1, part = _outputs(x)
    launch(x.reshape(-1, x.shape[-1]).contiguous(), None, None, q_MN, inv_M1, part, "identity", t)
    return q_MN, inv_M1, part.sum(0)


def _fake_rows(x: torch.Tensor):
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    f32 = {"dtype": torch.float32, "device": x.device}
    return torch.empty((M, N), dtype=E4M3, device=x.device), torch.empty((M, 1), **f32), torch.empty((N,), **f32)


@rowwise_fp8.register_fake
def _(x):
    return _fake_rows(x)


@gelu_backward_fp8.register_fake
def _(dy, h, approximate):
    return (torch.empty(dy.shape, dtype=dy.dtype, device=dy.device), *_fake_rows(dy))  # g contiguous, as written
