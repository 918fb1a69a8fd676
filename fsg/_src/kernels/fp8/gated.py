"""Fused FP8 casts for a gated MLP, ``down(act(gate(x)) * up(x))`` with ``act`` a SiLU (SwiGLU:
Llama, Mistral, Qwen, Phi-3 and most recent decoders) or a GELU (GeGLU: Gemma), for the
float8 pass (``passes/float8/producers.py`` matches them).

Shape legend: M rows (tokens), N the row width (the MLP's hidden width).

Each tensor an FP8 matmul of that MLP reads in rows is a product of two or three tensors
through the activation: left to Inductor, its cast is a row reduction fused with that product,
which is then computed again for the FP8 writes. Both ops below compute it, its rowwise
``float8_e4m3fn`` copy and inverse scales (and, where asked, its column sums and column
maxima) in one read of their inputs (``cast_kernel.py``'s kernel):

- ``gated_fp8(x, h, activation)``: ``g = act(x) * h``. In the forward the down-projection's
  input (``x`` the gate's output, ``h`` the up-projection's); in the backward the
  up-projection's output gradient (``x`` the gate's output, ``h`` the product's gradient).
- ``gated_backward_fp8(dy, h, y, activation)``: ``g = act_backward(dy * y, h)``, the gate's
  output gradient (``dy`` the product's gradient, ``y`` the up-projection's output, ``h`` the
  gate's output); ``y`` ``None`` for ``silu_backward(dy, h)`` alone.

``activation`` is ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``. The values equal the
unfused graph's aten ops (the references below): the product's first factor (``act(x)``,
``dy * y``) is rounded to the inputs' dtype before it is used, as aten's separate ops round it.
The inputs may be strided rows that share their strides (the halves of a fused gate-and-up
projection's output): the kernel reads them in place.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import use_triton
from fsg._src.kernels.column_sum import column_sum
from fsg._src.kernels.fp8.cast import _column_amax, _outputs, _rows_of, rowwise_fp8_reference
from fsg._src.kernels.fp8.cast_kernel import ACTIVATIONS, E4M3, launch, tiling

aten = torch.ops.aten
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x)`` as the aten op the graph has."""
    if activation == "silu":
        return aten.silu.default(x)
    return aten.gelu.default(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def activation_backward_reference(dy: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """``dy * act'(h)`` as the aten op the graph has."""
    if activation == "silu":
        return aten.silu_backward.default(dy, h)
    return aten.gelu_backward.default(dy, h, approximate="tanh" if activation == "gelu_tanh" else "none")


def _with_cast(g: torch.Tensor, column_sums: bool, column_amax: bool) -> Outputs:
    q, inv, colsum, colamax = rowwise_fp8_reference(g, column_amax)
    return g, q, inv, colsum if column_sums else colsum.new_zeros(0), colamax


def gated_fp8_reference(x, h, activation: str, column_sums: bool = False, column_amax: bool = False) -> Outputs:
    """``(g, q_MN, inv_M1, colsum, colamax)`` of ``g = act(x) * h`` in plain torch: the
    unfused graph's ops (``colsum`` ``[0]`` unless ``column_sums``)."""
    return _with_cast(aten.mul.Tensor(activation_reference(x, activation), h), column_sums, column_amax)


def gated_backward_fp8_reference(
    dy, h, y, activation: str, column_sums: bool = False, column_amax: bool = False
) -> Outputs:
    """``(g, q_MN, inv_M1, colsum, colamax)`` of ``g = act_backward(dy * y, h)`` (``dy`` alone
    when ``y`` is ``None``) in plain torch: the unfused graph's ops."""
    dy = dy if y is None else aten.mul.Tensor(dy, y)
    return _with_cast(activation_backward_reference(dy, h, activation), column_sums, column_amax)


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


def _check(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: must be one of {sorted(ACTIVATIONS)}")


@torch.library.custom_op("fsg::gated_fp8", mutates_args=())
def gated_fp8(
    x: torch.Tensor, h: torch.Tensor, activation: str, column_sums: bool = False, column_amax: bool = False
) -> Outputs:
    """``act(x) * h`` (both ``[..., N]``, one dtype), with the rowwise ``float8_e4m3fn`` copy
    of its ``[M, N]`` rows, their inverse scales ``[M, 1]``, its float32 column sums ``[N]``
    if ``column_sums`` (else ``[0]``) and the float32 column maxima of its magnitudes ``[N]``
    if ``column_amax`` (else ``[0]``)."""
    _check(activation)
    if not use_triton(x):
        return gated_fp8_reference(x, h, activation, column_sums, column_amax)
    return _launch(f"gated:{activation}", x, h, None, column_sums, column_amax)


@torch.library.custom_op("fsg::gated_backward_fp8", mutates_args=())
def gated_backward_fp8(
    dy: torch.Tensor, h: torch.Tensor, y: torch.Tensor | None, activation: str, column_sums: bool = False,
    column_amax: bool = False,
) -> Outputs:  # fmt: skip
    """``act_backward(dy * y, h)`` (``dy`` alone where ``y`` is ``None``, SiLU only: a GELU's
    is ``float8_cast.gelu_backward_fp8``; all ``[..., N]``, one dtype), with its rowwise FP8
    copy, inverse scales, column sums and column maxima as ``gated_fp8``'s."""
    _check(activation)
    if y is None and activation != "silu":
        raise ValueError("gated_backward_fp8 without a factor y: SiLU only (a GELU's is gelu_backward_fp8)")
    if not use_triton(dy):
        return gated_backward_fp8_reference(dy, h, y, activation, column_sums, column_amax)
    producer = f"gated_backward:{activation}" if y is None else f"gated_backward_mul:{activation}"
    return _launch(producer, dy, h, y, column_sums, column_amax)


def _fake(x, column_sums: bool, column_amax: bool) -> Outputs:
    N = x.shape[-1]
    M, f32 = (x.numel() // N if N else 0), {"dtype": torch.float32, "device": x.device}
    g = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as written
    q, inv = torch.empty((M, N), dtype=E4M3, device=x.device), torch.empty((M, 1), **f32)
    return g, q, inv, torch.empty((N if column_sums else 0,), **f32), torch.empty((N if column_amax else 0,), **f32)


@gated_fp8.register_fake
def _(x, h, activation, column_sums=False, column_amax=False):
    return _fake(x, column_sums, column_amax)


@gated_backward_fp8.register_fake
def _(dy, h, y, activation, column_sums=False, column_amax=False):
    return _fake(dy, column_sums, column_amax)
