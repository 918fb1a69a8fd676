"""Fused FP8 casts for the float8 pass (``passes/float8/matmuls.py``): a tensor's rowwise FP8 copy
(and, where a bias gradient sums it, its column sums) in one read, computed in the kernel
that produces the tensor where that producer is an elementwise op of the MLP or a
concatenation.

Shape legend: M rows (tokens), N the row width (the contracted dim of the matmul that reads the
FP8 copy), C the width of one piece of a concatenation.

Left to Inductor, each cast is a row reduction (the amax) fused with the tensor's producer,
and the producer is computed again for the writes (about twice its bytes' time:
benchmarks/RESULTS.md). One Triton kernel
(``cast_kernel.py``) does each case in one read of its inputs:

- ``gelu_backward_fp8``: the MLP's up-projection gradient ``g = dy * gelu'(h)``, read by the
  grad-input matmul (FP8, a scale per row), the grad-weight matmul (``g`` in bfloat16) and the
  bias gradient (``g``'s column sums): writes ``g``, its FP8 copy and inverse scales, and
  float32 column-sum partials (``PROGRAMS`` rows at most, summed by one ``column_sum`` launch).
- ``gelu_fp8``: the MLP's activation ``a = gelu(h)``, read by the down-projection (FP8) and
  its grad-weight (bfloat16): writes ``a``, its FP8 copy and scales.
- ``cat_rowwise_fp8``: a fused qkv projection's gradient, ``cat([dq, dk, dv], -1)``, whose
  pieces come transposed out of attention's backward: reads each piece in place and writes
  the concatenation, its FP8 copy, scales and column sums.
- ``rowwise_fp8``: the cast and column sums of a tensor already written that a bias gradient
  sums (the residual stream's gradient).

Each op can also return the column maxima of ``|g|`` (``column_amax=True``): the scales of
``g``'s transposed cast, which a grad-weight matmul in FP8 reads (``Float8(grad_weight="fp8")``),
so that cast needs no column reduction of its own over ``g``. The pass does not ask for them:
they cost the kernel more than the Inductor column reductions they replace (benchmarks/RESULTS.md).

The quantities equal the unfused graph's (``Quantizer.rowwise_operand``): the row maxima,
the column maxima and the column sums are of the rows rounded to their dtype,
``scale = fp8_max / max(amax, eps)``, ``q = saturate(g * scale)``, and ``_scaled_mm`` takes
``1 / scale``.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import RowTiling, use_triton
from fsg._src.kernels.column_sum import column_sum
from fsg._src.kernels.fp8.cast_kernel import AMAX_ROWS, launch, tiling
from fsg._src.kernels.fp8.cast_kernel import APPROXIMATIONS as APPROXIMATIONS
from fsg._src.kernels.fp8.cast_kernel import E4M3 as E4M3
from fsg._src.kernels.fp8.cast_kernel import EPS as EPS


def rowwise_fp8_reference(g, column_amax: bool = False, fp8_dtype: torch.dtype = E4M3):
    """``(q_MN, inv_M1, colsum_N, colamax)`` of ``g``'s rows in plain torch: the unfused
    graph's ops; ``colamax`` the column maxima of ``|g|`` (``[N]``), or ``[0]`` unless
    ``column_amax``."""
    g_MN = g.reshape(-1, g.shape[-1]).float()
    fp8_max = torch.finfo(fp8_dtype).max
    scale = g_MN.abs().amax(1, keepdim=True).clamp_min(EPS).reciprocal() * fp8_max
    q = (g_MN * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    colamax = g_MN.abs().amax(0) if column_amax and g_MN.shape[0] else g_MN.new_zeros(g_MN.shape[1] * column_amax)
    return q, scale.reciprocal(), g_MN.sum(0), colamax


def gelu_backward_fp8_reference(dy, h, approximate: str, column_amax: bool = False):
    """``(g, q_MN, inv_M1, colsum_N, colamax)`` in plain torch: the unfused graph's ops."""
    g = torch.ops.aten.gelu_backward.default(dy, h, approximate=approximate)
    return (g, *rowwise_fp8_reference(g, column_amax))


def gelu_fp8_reference(h, approximate: str, column_amax: bool = False):
    """``(a, q_MN, inv_M1, colamax)`` in plain torch: the unfused graph's ops."""
    a = torch.ops.aten.gelu.default(h, approximate=approximate)
    q, inv, _, colamax = rowwise_fp8_reference(a, column_amax)
    return a, q, inv, colamax


def cat_rowwise_fp8_reference(xs, column_amax: bool = False):
    """``(g, q_MN, inv_M1, colsum_N, colamax)`` of ``g = cat(xs, -1)`` in plain torch."""
    g = torch.cat(xs, -1)
    return (g, *rowwise_fp8_reference(g, column_amax))


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[M, C]`` rows with unit column stride: a view where its strides allow."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 or rows.shape[1] <= 1 else rows.contiguous()


def _outputs(M: int, N: int, device, t: RowTiling, colsum: bool, column_amax: bool):
    """The FP8 copy, the inverse scales and the column-sum and column-amax partials (or ``None``)."""
    f32 = {"dtype": torch.float32, "device": device}
    q, inv = torch.empty((M, N), dtype=E4M3, device=device), torch.empty((M, 1), **f32)
    colsum_part = torch.empty((t.programs, N), **f32) if colsum else None
    return q, inv, colsum_part, torch.zeros((min(AMAX_ROWS, t.programs), N), **f32) if column_amax else None


def _column_amax(part: torch.Tensor | None, N: int, device) -> torch.Tensor:
    """The column maxima from their partials (0 over no rows), or the ``[0]`` placeholder
    where not asked."""
    if part is None or not part.shape[0]:
        return torch.zeros((0 if part is None else N,), dtype=torch.float32, device=device)
    return part.amax(0)


def _num_rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


@torch.library.custom_op("fsg::gelu_backward_fp8", mutates_args=())
def gelu_backward_fp8(
    dy: torch.Tensor, h: torch.Tensor, approximate: str, column_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.gelu_backward(dy, h, approximate)`` (shape ``[..., N]``), with the rowwise
    ``float8_e4m3fn`` copy of its ``[M, N]`` rows, their inverse scales ``[M, 1]``, its
    float32 column sums ``[N]`` and, if ``column_amax``, the float32 column maxima of its
    magnitudes ``[N]`` (else ``[0]``)."""
    if not use_triton(dy):
        return gelu_backward_fp8_reference(dy, h, approximate, column_amax)
    N = dy.shape[-1]
    dy_MN, h_MN = dy.reshape(-1, N).contiguous(), h.reshape(-1, N).contiguous()
    t = tiling(dy_MN.shape[0], N, "gelu_backward")
    q_MN, inv_M1, part, amax_part = _outputs(dy_MN.shape[0], N, dy.device, t, True, column_amax)
    g_MN = torch.empty_like(dy_MN)
    launch([dy_MN], h_MN, g_MN, q_MN, inv_M1, part, f"gelu_backward:{approximate}", t, amax_part)
    return g_MN.reshape(dy.shape), q_MN, inv_M1, column_sum(part), _column_amax(amax_part, N, dy.device)


@torch.library.custom_op("fsg::gelu_fp8", mutates_args=())
def gelu_fp8(
    h: torch.Tensor, approximate: str, column_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.gelu(h, approximate)`` (shape ``[..., N]``), with the rowwise ``float8_e4m3fn``
    copy of its ``[M, N]`` rows, their inverse scales ``[M, 1]`` and, if ``column_amax``, the
    column maxima of its magnitudes ``[N]`` (else ``[0]``), in one read of ``h``."""
    if not use_triton(h):
        return gelu_fp8_reference(h, approximate, column_amax)
    h_MN = _rows_of(h)
    M, N = h_MN.shape
    t = tiling(M, N, "gelu")
    q_MN, inv_M1, _, amax_part = _outputs(M, N, h.device, t, False, column_amax)
    a_MN = torch.empty((M, N), dtype=h.dtype, device=h.device)
    launch([h_MN], None, a_MN, q_MN, inv_M1, None, f"gelu:{approximate}", t, amax_part)
    return a_MN.reshape(h.shape), q_MN, inv_M1, _column_amax(amax_part, N, h.device)


@torch.library.custom_op("fsg::rowwise_fp8", mutates_args=())
def rowwise_fp8(
    x: torch.Tensor, column_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rowwise ``float8_e4m3fn`` copy of ``x``'s ``[M, N]`` rows, their inverse scales
    ``[M, 1]``, ``x``'s float32 column sums ``[N]`` and, if ``column_amax``, the column
    maxima of its magnitudes ``[N]`` (else ``[0]``), in one read of ``x``."""
    if not use_triton(x):
        return rowwise_fp8_reference(x, column_amax)
    x_MN = _rows_of(x)
    t = tiling(*x_MN.shape)
    q_MN, inv_M1, part, amax_part = _outputs(*x_MN.shape, x.device, t, True, column_amax)
    launch([x_MN], None, None, q_MN, inv_M1, part, "identity", t, amax_part)
    return q_MN, inv_M1, column_sum(part), _column_amax(amax_part, x_MN.shape[1], x.device)


@torch.library.custom_op("fsg::cat_rowwise_fp8", mutates_args=())
def cat_rowwise_fp8(
    xs: list[torch.Tensor], column_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g = cat(xs, -1)`` of two or three pieces of one shape ``[..., C]`` (contiguous), with
    the rowwise ``float8_e4m3fn`` copy of its ``[M, N]`` rows, their inverse scales ``[M, 1]``,
    its float32 column sums ``[N]`` and, if ``column_amax``, the column maxima of its
    magnitudes ``[N]`` (else ``[0]``), reading each piece once (strided pieces too: an
    attention gradient's transposed heads)."""
    if not use_triton(xs[0]):
        return cat_rowwise_fp8_reference(xs, column_amax)
    pieces = [_rows_of(x) for x in xs]
    (M, C), N = pieces[0].shape, xs[0].shape[-1] * len(xs)
    t = tiling(M, C, pieces=len(xs))
    q_MN, inv_M1, part, amax_part = _outputs(M, N, xs[0].device, t, True, column_amax)
    g_MN = torch.empty((M, N), dtype=xs[0].dtype, device=xs[0].device)
    launch(pieces, None, g_MN, q_MN, inv_M1, part, "identity", t, amax_part)
    return g_MN.reshape(*xs[0].shape[:-1], N), q_MN, inv_M1, column_sum(part), _column_amax(amax_part, N, xs[0].device)


def _fake_rows(x: torch.Tensor, column_amax: bool, N: int | None = None, colsum: bool = True):
    N = x.shape[-1] if N is None else N
    M, f32 = _num_rows(x), {"dtype": torch.float32, "device": x.device}
    q, inv = torch.empty((M, N), dtype=E4M3, device=x.device), torch.empty((M, 1), **f32)
    colamax = torch.empty((N if column_amax else 0,), **f32)
    return (q, inv, torch.empty((N,), **f32), colamax) if colsum else (q, inv, colamax)


@rowwise_fp8.register_fake
def _(x, column_amax=False):
    return _fake_rows(x, column_amax)


@gelu_backward_fp8.register_fake
def _(dy, h, approximate, column_amax=False):  # g contiguous, as written
    return (torch.empty(dy.shape, dtype=dy.dtype, device=dy.device), *_fake_rows(dy, column_amax))


@gelu_fp8.register_fake
def _(h, approximate, column_amax=False):
    return (torch.empty(h.shape, dtype=h.dtype, device=h.device), *_fake_rows(h, column_amax, colsum=False))


@cat_rowwise_fp8.register_fake
def _(xs, column_amax=False):
    N = xs[0].shape[-1] * len(xs)
    g = torch.empty((*xs[0].shape[:-1], N), dtype=xs[0].dtype, device=xs[0].device)
    return (g, *_fake_rows(xs[0], column_amax, N))
