"""Fused FP8 casts for a gated (SwiGLU) MLP, ``down(silu(gate(x)) * up(x))`` (Llama, Mistral,
Qwen and most recent decoders), for the float8 pass (``passes/float8_fuse.py``).

Shape legend: M rows (tokens), N the row width (the MLP's hidden width).

Each tensor an FP8 matmul of that MLP reads in rows is a product of two or three tensors
through a SiLU: left to Inductor, its cast is a row reduction fused with that product, which
is then computed again for the FP8 writes. Both ops below compute it, its rowwise
``float8_e4m3fn`` copy and inverse scales (and, where asked, its column sums and column
maxima) in one read of their inputs (``float8_cast_kernel.py``'s kernel):

- ``silu_mul_fp8(x, h)``: ``g = silu(x) * h``. In the forward the down-projection's input
  (``x`` the gate's output, ``h`` the up-projection's); in the backward the up-projection's
  output gradient (``x`` the gate's output, ``h`` the product's gradient).
- ``silu_backward_fp8(dy, h, y)``: ``g = silu_backward(dy * y, h)``, the gate's output
  gradient (``dy`` the product's gradient, ``y`` the up-projection's output, ``h`` the gate's
  output); ``y`` ``None`` for ``silu_backward(dy, h)`` alone.

The values equal the unfused graph's ops (the references below): the intermediate product
(``silu(x)``, ``dy * y``) is rounded to the inputs' dtype before it is used, as aten's
separate ops round it.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import use_triton
from fsg._src.kernels.column_sum import column_sum
from fsg._src.kernels.float8_cast import _column_amax, _outputs, _rows_of, rowwise_fp8_reference
from fsg._src.kernels.float8_cast_kernel import E4M3, launch, tiling

aten = torch.ops.aten
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _with_cast(g: torch.Tensor, column_sums: bool, column_amax: bool) -> Outputs:
    q, inv, colsum, colamax = rowwise_fp8_reference(g, column_amax)
    return g, q, inv, colsum if column_sums else colsum.new_zeros(0), colamax


def silu_mul_fp8_reference(x, h, column_sums: bool = False, column_amax: bool = False) -> Outputs:
    """``(g, q_MN, inv_M1, colsum, colamax)`` of ``g = silu(x) * h`` in plain torch: the
    unfused graph's ops (``colsum`` ``[0]`` unless ``column_sums``)."""
    return _with_cast(aten.mul.Tensor(aten.silu.default(x), h), column_sums, column_amax)


def silu_backward_fp8_reference(dy, h, y=None, column_sums: bool = False, column_amax: bool = False) -> Outputs:
    """``(g, q_MN, inv_M1, colsum, colamax)`` of ``g = silu_backward(dy * y, h)`` (``dy``
    alone when ``y`` is ``None``) in plain torch: the unfused graph's ops."""
    dy = dy if y is None else aten.mul.Tensor(dy, y)
    return _with_cast(aten.silu_backward.default(dy, h), column_sums, column_amax)


def _rows(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as ``[M, N]`` rows of one row stride: views where they have one (the two
    halves of a fused gate-and-up projection's output), else row-major copies."""
    views = [_rows_of(t) for t in ts]
    return views if len({v.stride() for v in views}) == 1 else [v.contiguous() for v in views]


def _launch(producer: str, x, h, y, column_sums: bool, column_amax: bool) -> Outputs:
    N = x.shape[-1]
    x_MN, h_MN, *y_MN = _rows(*(t for t in (x, h, y) if t is not None))
    y_MN = y_MN[0] if y_MN else None
    M = x_MN.shape[0]
    t = tiling(M, N, producer)
    q_MN, inv_M1, part, amax_part = _outputs(M, N, x.device, t, column_sums, column_amax)
    g_MN = torch.empty((M, N), dtype=x.dtype, device=x.device)
    launch([x_MN], h_MN, g_MN, q_MN, inv_M1, part, producer, t, amax_part, y_MC=y_MN)
    colsum = column_sum(part) if column_sums else torch.zeros((0,), dtype=torch.float32, device=x.device)
    return g_MN.view(x.shape), q_MN, inv_M1, colsum, _column_amax(amax_part, N, x.device)


@torch.library.custom_op("fsg::silu_mul_fp8", mutates_args=())
def silu_mul_fp8(x: torch.Tensor, h: torch.Tensor, column_sums: bool = False, column_amax: bool = False) -> Outputs:
    """``silu(x) * h`` (both ``[..., N]``, one dtype), with the rowwise ``float8_e4m3fn`` copy
    of its ``[M, N]`` rows, their inverse scales ``[M, 1]``, its float32 column sums ``[N]``
    if ``column_sums`` (else ``[0]``) and the float32 column maxima of its magnitudes ``[N]``
    if ``column_amax`` (else ``[0]``)."""
    if not use_triton(x):
        return silu_mul_fp8_reference(x, h, column_sums, column_amax)
    return _launch("silu_mul", x, h, None, column_sums, column_amax)


@torch.library.custom_op("fsg::silu_backward_fp8", mutates_args=())
def silu_backward_fp8(
    dy: torch.Tensor, h: torch.Tensor, y: torch.Tensor | None, column_sums: bool = False, column_amax: bool = False
) -> Outputs:
    """``aten.silu_backward(dy * y, h)`` (``dy`` alone where ``y`` is ``None``; all
    ``[..., N]``, one dtype), with its rowwise FP8 copy, inverse scales, column sums and
    column maxima as ``silu_mul_fp8``'s."""
    if not use_triton(dy):
        return silu_backward_fp8_reference(dy, h, y, column_sums, column_amax)
    return _launch("silu_backward" if y is None else "silu_backward_mul", dy, h, y, column_sums, column_amax)


def _fake(x, column_sums: bool, column_amax: bool) -> Outputs:
    N = x.shape[-1]
    M, f32 = (x.numel() // N if N else 0), {"dtype": torch.float32, "device": x.device}
    g = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as written
    q, inv = torch.empty((M, N), dtype=E4M3, device=x.device), torch.empty((M, 1), **f32)
    return g, q, inv, torch.empty((N if column_sums else 0,), **f32), torch.empty((N if column_amax else 0,), **f32)


@silu_mul_fp8.register_fake
def _(x, h, column_sums=False, column_amax=False):
    return _fake(x, column_sums, column_amax)


@silu_backward_fp8.register_fake
def _(dy, h, y, column_sums=False, column_amax=False):
    return _fake(dy, column_sums, column_amax)
