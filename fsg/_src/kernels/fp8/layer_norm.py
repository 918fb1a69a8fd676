"""A layer norm's forward with the rowwise FP8 cast of its output, in one read of its input:
the float8 pass's op for a matmul operand that a layer norm produces (``passes/float8/fuse.py``,
``Fusions.fp8_layer_norms``).

Shape legend: M rows (every leading dim flattened), N the normalized width (the contracted dim
of the matmul that reads the FP8 copy).

Left to Inductor, the cast is a second row reduction (the amax of the rounded output) fused into
the layer norm's kernel or after it (most of a rowwise step's cast time at GPT-2 355M:
benchmarks/RESULTS.md). Here each program normalizes whole rows and
casts them while they are in registers: it reads ``x`` once and writes ``y``, its FP8 copy, the
inverse scales and the statistics.

The quantities are the unfused graph's: ``y`` as ``aten.native_layer_norm`` computes it
(float32 statistics, to rounding: the order of the sums differs), then the row maxima of ``y``
rounded to its dtype, ``scale = fp8_max / max(amax, eps)``, ``q = saturate(y * scale)``, and
``_scaled_mm`` takes ``1 / scale`` (``float8_cast.rowwise_fp8_reference``).
"""

from __future__ import annotations

import functools

import torch

from fsg._src.kernels._common import RowTiling, tl, triton, use_triton
from fsg._src.kernels.fp8.cast import E4M3, EPS, rowwise_fp8_reference
from fsg._src.kernels.fp8.cast_kernel import saturate, scale_of, tiling

DTYPES = (torch.bfloat16, torch.float16)  # the output dtypes the pass fuses (an FP8 matmul's operand)


@triton.jit
def _layer_norm_fp8_kernel(
    x_ptr, r_ptr, s_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, q_ptr, inv_ptr, M, N, eps, fp8_max, amax_eps,
    HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr, ITERS: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr = 1,
):  # fmt: skip
    """``ITERS`` tiles of ``ROWS`` rows a program: with ``HAS_R`` the sum ``x + r`` first, stored
    in ``x``'s dtype and normalized as stored; statistics in float32, ``y`` stored in its dtype,
    its rounded values' row maxima, scales and FP8 copy."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) if HAS_W else None
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) if HAS_B else None
    for it in tl.range(ITERS, num_stages=STAGES):
        rows = ((pid * ITERS + it) * ROWS).to(tl.int64) + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_R:  # the residual add, rounded as the graph's add rounds it
            x = (x.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(s_ptr + offs, x, mask=mask)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * w[None, :]
        if HAS_B:
            y = y + b[None, :]
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, y, mask=mask)
        tl.store(mean_ptr + rows, mean, mask=row_ok)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        g = tl.where(mask, y.to(tl.float32), 0.0)  # what y's readers see: its rounded values
        scale = scale_of(tl.max(tl.abs(g), axis=1), amax_eps, fp8_max)
        tl.store(inv_ptr + rows, 1.0 / scale, mask=row_ok)
        q = saturate(g, scale[:, None], fp8_max)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def launch(
    x_MN, w, b, y_MN, mean_M, rstd_M, q_MN, inv_M, eps: float, t: RowTiling | None = None, r_MN=None, s_MN=None
) -> None:
    """Writes into the given outputs (``w``, ``b``: ``[N]`` or ``None``; with ``r_MN``, the
    norm is of ``x + r``, written to ``s_MN``). ``q_MN`` is scaled for ``float8_e4m3fn``
    whatever its dtype (the CPU tests pass float32)."""
    M, N = x_MN.shape
    t = t or tiling(M, N)
    has_r = r_MN is not None
    _layer_norm_fp8_kernel[(t.programs,)](
        x_MN, r_MN if has_r else x_MN, s_MN if has_r else x_MN, x_MN if w is None else w, x_MN if b is None else b,
        y_MN, mean_M, rstd_M, q_MN, inv_M, M, N, eps,
        float(torch.finfo(E4M3).max), EPS, HAS_R=has_r, HAS_W=w is not None, HAS_B=b is not None,
        ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, STAGES=t.stages, num_warps=t.num_warps,
    )  # fmt: skip


def layer_norm_fp8_reference(x, weight, bias, eps: float):
    """``(y, mean, rstd, q_MN, inv_M1)`` in plain torch: the unfused graph's ops."""
    y, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [x.shape[-1]], weight, bias, eps)
    q, inv, _, _ = rowwise_fp8_reference(y)
    return y, mean, rstd, q, inv


def _statistics_like(x: torch.Tensor) -> torch.dtype:
    """The dtype ``aten.native_layer_norm`` gives its mean and rstd for ``x``: ``x``'s on CPU;
    elsewhere its meta function's (float32 for a half-precision input, as CUDA's kernel)."""
    return x.dtype if x.device.type == "cpu" else _meta_statistics_dtype(x.dtype)


@functools.cache
def _meta_statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Asked once a dtype: the meta function runs in Python, slower than the kernel it describes."""
    meta = torch.empty((1, 8), dtype=dtype, device="meta")
    return torch.ops.aten.native_layer_norm.default(meta, [8], None, None, 1e-5)[1].dtype


def _run(x: torch.Tensor, residual: torch.Tensor | None, weight, bias, eps: float) -> tuple[torch.Tensor, ...]:
    """The kernel on ``x`` (plus ``residual``): ``(s, y, mean, rstd, q, inv)`` shaped as the ops
    return them (``s`` is ``None`` without a residual)."""
    N = x.shape[-1]
    x_MN = x.reshape(-1, N).contiguous()
    r_MN = None if residual is None else residual.reshape(-1, N).contiguous()
    M = x_MN.shape[0]
    f32 = {"dtype": torch.float32, "device": x.device}
    s_MN = None if residual is None else torch.empty_like(x_MN)
    y_MN, mean, rstd = torch.empty_like(x_MN), torch.empty(M, **f32), torch.empty(M, **f32)
    q_MN, inv = torch.empty((M, N), dtype=E4M3, device=x.device), torch.empty((M, 1), **f32)
    w, b = (None if v is None else v.contiguous() for v in (weight, bias))
    launch(x_MN, w, b, y_MN, mean, rstd, q_MN, inv, eps, r_MN=r_MN, s_MN=s_MN)
    stats, stats_dtype = (*x.shape[:-1], 1), _statistics_like(x)
    s = None if s_MN is None else s_MN.reshape(x.shape)
    return s, y_MN.reshape(x.shape), mean.reshape(stats).to(stats_dtype), rstd.reshape(stats).to(stats_dtype), q_MN, inv


@torch.library.custom_op("fsg::layer_norm_fp8", mutates_args=())
def layer_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.native_layer_norm(x, [N], weight, bias, eps)`` over the last dim (``y``, and
    the mean and rstd as it returns them), with the rowwise ``float8_e4m3fn`` copy of ``y``'s
    ``[M, N]`` rows and their inverse scales ``[M, 1]``."""
    if not use_triton(x) or x.dtype not in DTYPES:
        return layer_norm_fp8_reference(x, weight, bias, eps)
    return _run(x, None, weight, bias, eps)[1:]


@layer_norm_fp8.register_fake
def _(x, weight, bias, eps):
    y, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [x.shape[-1]], weight, bias, eps)
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    q = torch.empty((M, x.shape[-1]), dtype=E4M3, device=x.device)
    return y, mean, rstd, q, torch.empty((M, 1), dtype=torch.float32, device=x.device)


@torch.library.custom_op("fsg::add_layer_norm_fp8", mutates_args=())
def add_layer_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (a residual stream's add) and ``layer_norm_fp8(s, ...)`` in one read
    of ``x`` and ``residual``: ``(s, y, mean, rstd, q, inv)``."""
    if not use_triton(x) or x.dtype not in DTYPES or residual.dtype != x.dtype or residual.shape != x.shape:
        s = x + residual
        return (s, *layer_norm_fp8_reference(s, weight, bias, eps))
    return _run(x, residual, weight, bias, eps)


@add_layer_norm_fp8.register_fake
def _(x, residual, weight, bias, eps):
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    return (s, *torch.ops.fsg.layer_norm_fp8(s, weight, bias, eps))
