"""A layer norm's backward with the residual stream's gradient add and the rowwise FP8 cast of
the sum, in one read of its inputs: the float8 pass's op for a matmul operand that a layer
norm's backward produces (``passes/float8_norms.py``, ``FUSE_NORM_BACKWARDS``).

Shape legend: M rows (every leading dim flattened), N the normalized width (the contracted dim
of the grad-input matmul that reads the FP8 copy), P programs (partial rows), K the column sums
asked (of ``dw``, ``db``, ``dx``: 0 to 3).

In a pre-norm transformer the residual stream's gradient is ``dx = r + LN_backward(dy)`` at
every norm, and it is the output gradient of the linear layer before the norm (GPT's ``proj``
and ``fc2``): its grad-input matmul reads ``dx`` in FP8, a scale per row, and its bias gradient
sums ``dx``'s columns. Left unfused, Inductor's kernel computes the norm's backward and the add
and writes ``dx``, and ``fsg::rowwise_fp8`` reads ``dx`` again for the cast and the sums (two
launches a norm, 48 a step at GPT-2 355M). Here each program computes whole rows of ``dx``,
casts them while they are in registers, and sums the norm's weight and bias gradients and
``dx``'s columns into float32 partials (one ``[P, K * N]`` buffer, one ``column_sum`` launch).

The quantities are the unfused graph's: ``aten.native_layer_norm_backward``'s ``dx`` rounded to
its dtype (to rounding: the order of the sums differs), the add rounded as the graph's add, then
the row maxima of the rounded sum, ``scale = fp8_max / max(amax, eps)``, ``q = saturate(dx *
scale)``, ``_scaled_mm`` takes ``1 / scale``; ``dw = sum(dy * xhat)``, ``db = sum(dy)`` over
the rows, in the weight's dtype.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import RowTiling, tl, triton, use_triton
from fsg._src.kernels.column_sum import column_sum
from fsg._src.kernels.float8_cast import E4M3, EPS, rowwise_fp8_reference
from fsg._src.kernels.float8_cast_kernel import saturate, scale_of
from fsg._src.kernels.float8_cast_kernel import tiling as cast_tiling

DTYPES = (torch.bfloat16, torch.float16)  # the gradient dtypes the kernel serves (an FP8 matmul's operand)


@triton.jit
def _layer_norm_backward_fp8_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, r_ptr, dx_ptr, q_ptr, inv_ptr, part_ptr, M, N, fp8_max, amax_eps,
    HAS_W: tl.constexpr, HAS_R: tl.constexpr, DW: tl.constexpr, DB: tl.constexpr, COLSUM: tl.constexpr,
    ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr = 1,
):  # fmt: skip
    """``ITERS`` tiles of ``ROWS`` rows a program: ``dx`` as the norm's backward gives it,
    rounded to its dtype, plus ``r`` (rounded again, as the graph's add), stored; its row maxima,
    scales and FP8 copy; the program's partial column sums of ``dy * xhat``, ``dy`` and ``dx``
    (those asked, in that order) in its row of ``part``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) if HAS_W else None
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    cs = tl.zeros([BLOCK], tl.float32)
    for it in tl.range(ITERS, num_stages=STAGES):
        rows = ((pid * ITERS + it) * ROWS).to(tl.int64) + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        dxhat = dy * w[None, :] if HAS_W else dy
        c1 = tl.sum(dxhat * xhat, axis=1) / N
        c2 = tl.sum(dxhat, axis=1) / N
        dx = (rstd[:, None] * (dxhat - c2[:, None] - xhat * c1[:, None])).to(dx_ptr.dtype.element_ty)
        if HAS_R:  # the residual stream's gradient, added as the graph's add rounds it
            dx = (dx.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dx.dtype)
        tl.store(dx_ptr + offs, dx, mask=mask)
        g = tl.where(mask, dx.to(tl.float32), 0.0)  # what dx's readers see: its rounded values
        scale = scale_of(tl.max(tl.abs(g), axis=1), amax_eps, fp8_max)
        tl.store(inv_ptr + rows, 1.0 / scale, mask=row_ok)
        q = saturate(g, scale[:, None], fp8_max)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        if DW:
            dw += tl.sum(dy * xhat, axis=0)
        if DB:
            db += tl.sum(dy, axis=0)
        if COLSUM:
            cs += tl.sum(g, axis=0)
    row = part_ptr + pid.to(tl.int64) * (DW + DB + COLSUM) * N + cols
    if DW:
        tl.store(row, dw, mask=col_ok)
    if DB:
        tl.store(row + DW * N, db, mask=col_ok)
    if COLSUM:
        tl.store(row + (DW + DB) * N, cs, mask=col_ok)


def tiling(M: int, N: int) -> RowTiling:
    """The cast kernels' tiling (``float8_cast_kernel.tiling``: one row a tile, ~1024-2048
    programs walking the rows), not the plain norm backward's (``RowTiling(backward=True)``,
    ~4096-element tiles of 2-4 rows): with that one this kernel ran 256 us a norm at GPT-2
    355M's ``[16384, 1024]`` on an H100 (2026-12-07, RESULTS.md), 5.7x its bytes' time, as
    the H200 sweeps had found 2- and 4-row tiles 1.1-10x slower than one row for the casts.
    Not yet measured with this one."""
    return cast_tiling(M, N)


def launch(dy_MN, x_MN, w, mean_M, rstd_M, r_MN, dx_MN, q_MN, inv_M, part, sums: tuple[bool, bool, bool], t=None):
    """Writes into the given outputs (``w``: ``[N]`` or ``None``; ``r_MN``: the residual
    gradient or ``None``; ``part``: ``[t.programs, K * N]`` float32, ``K = sum(sums)``, for the
    column sums ``sums`` asks: of ``dw``, ``db``, ``dx``). ``q_MN`` is scaled for
    ``float8_e4m3fn`` whatever its dtype (the CPU tests pass float32)."""
    M, N = dy_MN.shape
    t = t or tiling(M, N)
    _layer_norm_backward_fp8_kernel[(t.programs,)](
        dy_MN, x_MN, dy_MN if w is None else w, mean_M, rstd_M, dy_MN if r_MN is None else r_MN, dx_MN, q_MN, inv_M,
        dy_MN if part is None else part, M, N, float(torch.finfo(E4M3).max), EPS,
        HAS_W=w is not None, HAS_R=r_MN is not None, DW=sums[0], DB=sums[1], COLSUM=sums[2],
        ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, STAGES=t.stages, num_warps=t.num_warps,
    )  # fmt: skip


def layer_norm_backward_fp8_reference(dy, x, mean, rstd, weight, bias, output_mask, residual, column_sums: bool):
    """``(dx, q_MN, inv_M1, colsum_N, dw, db)`` in plain torch: the unfused graph's ops (``dw``,
    ``db``: ``[0]`` where ``output_mask`` asks none; ``colsum``: ``[0]`` unless asked)."""
    N = x.shape[-1]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward.default(dy, x, [N], mean, rstd, weight, bias, output_mask)
    if residual is not None:
        dx = residual + dx
    q, inv, colsum, _ = rowwise_fp8_reference(dx)
    colsum = colsum if column_sums else torch.empty(0, dtype=torch.float32, device=x.device)
    return dx, q, inv, colsum, *(_or_empty(v, x) for v in (dw, db))


def _or_empty(v: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device) if v is None else v


def _serves(dy, x, mean, rstd, weight, residual) -> bool:
    """Whether the kernel computes this case (else the reference runs): half-precision rows of
    one dtype, float32 statistics, a weight (if any) of the rows' width."""
    N = x.shape[-1]
    ok = dy.dtype in DTYPES and x.dtype == dy.dtype and dy.shape == x.shape and N > 0 and x.numel() > 0
    ok = ok and mean.dtype == rstd.dtype == torch.float32 and mean.numel() == rstd.numel() == x.numel() // N
    ok = ok and (weight is None or tuple(weight.shape) == (N,))
    return ok and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))


@torch.library.custom_op("fsg::layer_norm_backward_fp8", mutates_args=())
def layer_norm_backward_fp8(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
    bias: torch.Tensor | None, output_mask: list[bool], residual: torch.Tensor | None, column_sums: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``dx, dw, db = aten.native_layer_norm_backward(dy, x, [N], mean, rstd, weight, bias,
    output_mask)`` over the last dim, ``dx`` plus ``residual`` (where given), with the rowwise
    ``float8_e4m3fn`` copy of that sum's ``[M, N]`` rows, their inverse scales ``[M, 1]`` and,
    if ``column_sums``, its float32 column sums ``[N]`` (else ``[0]``): ``(dx, q, inv, colsum,
    dw, db)``, ``dw`` and ``db`` ``[0]`` where ``output_mask`` asks none. ``output_mask[0]``
    must be true."""
    if not use_triton(x) or not _serves(dy, x, mean, rstd, weight, residual):
        return layer_norm_backward_fp8_reference(dy, x, mean, rstd, weight, bias, output_mask, residual, column_sums)
    N = x.shape[-1]
    rows = [t.reshape(-1, N).contiguous() for t in (dy, x)]
    M = rows[0].shape[0]
    stats = [t.reshape(M).contiguous() for t in (mean, rstd)]
    r_MN = None if residual is None else residual.reshape(M, N).contiguous()
    w = None if weight is None else weight.contiguous()
    sums = (bool(output_mask[1]) and w is not None, bool(output_mask[2]) and bias is not None, column_sums)
    t = tiling(M, N)
    f32 = {"dtype": torch.float32, "device": x.device}
    part = torch.empty((t.programs, sum(sums) * N), **f32) if any(sums) else None
    dx_MN, q_MN, inv = (
        torch.empty_like(rows[0]),
        torch.empty((M, N), dtype=E4M3, device=x.device),
        torch.empty((M, 1), **f32),
    )
    launch(*rows, w, *stats, r_MN, dx_MN, q_MN, inv, part, sums, t)
    totals = iter(column_sum(part).split(N) if part is not None else ())
    dw, db, colsum = (next(totals) if asked else None for asked in sums)
    # copies: a custom op's outputs may not share storage (dw, db and colsum are one buffer's slices)
    dw = _or_empty(None if dw is None else dw.to(weight.dtype, copy=True), x)
    db = _or_empty(None if db is None else db.to(bias.dtype, copy=True), x)
    return dx_MN.reshape(x.shape), q_MN, inv, torch.empty(0, **f32) if colsum is None else colsum, dw, db


@layer_norm_backward_fp8.register_fake
def _(dy, x, mean, rstd, weight, bias, output_mask, residual, column_sums):
    N = x.shape[-1]
    M, f32 = (x.numel() // N if N else 0), {"dtype": torch.float32, "device": x.device}
    dw, db = (
        torch.empty((N,), dtype=v.dtype, device=x.device) if asked and v is not None else _or_empty(None, x)
        for asked, v in zip(output_mask[1:], (weight, bias))
    )
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty((M, N), dtype=E4M3, device=x.device),
        torch.empty((M, 1), **f32), torch.empty((N if column_sums else 0,), **f32), dw, db,
    )  # fmt: skip
