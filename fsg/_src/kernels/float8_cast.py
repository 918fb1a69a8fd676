"""Fused FP8 casts for the float8 pass (``passes/float8.py``): a producer, its rowwise FP8 copy,
and the column sums, in one read of the producer's inputs.

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

The quantities equal the unfused graph's (``Quantizer.rowwise_operand`` on ``g``): the row
maxima and the column sums are of ``g`` rounded to bfloat16, ``scale = fp8_max / max(amax,
eps)``, ``q = saturate(g * scale)``, and ``_scaled_mm`` takes ``1 / scale``.
"""

from __future__ import annotations

import math

import torch

from fsg._src.kernels._common import RowTiling, tl, triton, use_triton

E4M3 = torch.float8_e4m3fn
EPS = 1e-12  # the smallest amax a scale is computed from (passes/float8_quantize.py's EPS)
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


@triton.jit
def _gelu_backward_fp8_kernel(
    dy_ptr, h_ptr, g_ptr, q_ptr, inv_ptr, colsum_part_ptr, M, N, fp8_max, eps,
    TANH: tl.constexpr, ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    colsum = tl.zeros([BLOCK], tl.float32)
    for it in range(ITERS):
        first = (pid * ITERS + it) * ROWS
        rows = first.to(tl.int64) + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < N)[None, :]
        offs = rows[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = (dy * _gelu_grad(h, TANH)).to(g_ptr.dtype.element_ty)
        tl.store(g_ptr + offs, g, mask=mask)
        g = tl.where(mask, g.to(tl.float32), 0.0)  # what the readers of g see: its rounded values
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


def launch(dy_MN, h_MN, g_MN, q_MN, inv_M, colsum_part_PN, approximate: str, t: RowTiling | None = None) -> None:
    """Writes into the given outputs; ``colsum_part_PN`` has ``t.programs`` rows (default
    tiling: ``tiling(M, N)``), whose sum is ``g``'s column sums. ``q_MN`` is scaled for
    ``float8_e4m3fn`` whatever its dtype (the CPU tests pass float32: see their docstring)."""
    M, N = dy_MN.shape
    t = t or tiling(M, N)
    _gelu_backward_fp8_kernel[(t.programs,)](
        dy_MN, h_MN, g_MN, q_MN, inv_M, colsum_part_PN, M, N, float(torch.finfo(E4M3).max), EPS,
        TANH=approximate == "tanh", ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, num_warps=t.num_warps,
    )  # fmt: skip


def gelu_backward_fp8_reference(dy, h, approximate: str, fp8_dtype: torch.dtype = E4M3):
    """``(g, q_MN, inv_M1, colsum_N)`` in plain torch: the unfused graph's ops."""
    n = dy.shape[-1]
    g = torch.ops.aten.gelu_backward.default(dy, h, approximate=approximate)
    g_MN = g.reshape(-1, n).float()
    fp8_max = torch.finfo(fp8_dtype).max
    scale = g_MN.abs().amax(1, keepdim=True).clamp_min(EPS).reciprocal() * fp8_max
    q = (g_MN * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return g, q, scale.reciprocal(), g_MN.sum(0)


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
    M = dy_MN.shape[0]
    t = tiling(M, N)
    g_MN = torch.empty_like(dy_MN)
    q_MN = torch.empty((M, N), dtype=E4M3, device=dy.device)
    inv_M1 = torch.empty((M, 1), dtype=torch.float32, device=dy.device)
    part = torch.empty((t.programs, N), dtype=torch.float32, device=dy.device)
    launch(dy_MN, h_MN, g_MN, q_MN, inv_M1, part, approximate, t)
    return g_MN.reshape(dy.shape), q_MN, inv_M1, part.sum(0)


@gelu_backward_fp8.register_fake
def _(dy, h, approximate):
    N = dy.shape[-1]
    M = dy.numel() // N if N else 0
    f32 = {"dtype": torch.float32, "device": dy.device}
    return (
        torch.empty(dy.shape, dtype=dy.dtype, device=dy.device),  # contiguous, as the kernel writes it
        torch.empty((M, N), dtype=E4M3, device=dy.device),
        torch.empty((M, 1), **f32),
        torch.empty((N,), **f32),
    )
