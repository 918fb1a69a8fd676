"""Fused FP8 casts for the float8 pass (``passes/float8.py``): a tensor's rowwise FP8 copy
(and, where a bias gradient sums it, its column sums) in one read, computed in the kernel
that produces the tensor where that producer is an elementwise op of the MLP or a
concatenation.

Shape legend: M rows (tokens), N the row width (the contracted dim of the matmul that reads the
FP8 copy), C the width of one piece of a concatenation.

Left to Inductor, each cast is a row reduction (the amax) fused with the tensor's producer,
and the producer is computed again for the writes (benchmarks/RESULTS.md: 226 us a layer for
the MLP's GELU gradient at GPT-2 355M on the H200, where its bytes need ~100). One Triton kernel
(``float8_cast_kernel.py``) does each case in one read of its inputs:

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

import torch

from fsg._src.kernels._common import RowTiling, use_triton
from fsg._src.kernels.float8_cast_kernel import APPROXIMATIONS as APPROXIMATIONS
from fsg._src.kernels.float8_cast_kernel import E4M3 as E4M3
from fsg._src.kernels.float8_cast_kernel import EPS as EPS
from fsg._src.kernels.float8_cast_kernel import launch, tiling


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
