"""A bias gradient summed in the kernel that produces the tensor it sums: the registered ops
the ``fuse_bias_grads`` pass (``passes/fuse_bias_grads.py``) puts in a 16-bit step.

Shape legend: M rows (tokens), N the row width, C the width of one piece of a concatenation.

Left to Inductor, a linear layer's bias gradient ``sum(g, 0)`` is a column reduction of its
own over ``g`` after the kernel that wrote ``g`` (GPT-2 124M on the H200: 35 us a layer for
the MLP's GELU gradient, 21 us for the attention's ``cat`` of ``dq, dk, dv``, on top of the
84 and 35 us that produce them). The row kernel of ``float8_cast_kernel.py``, with its FP8
cast off, produces ``g``, writes it and sums its columns in the same visit:

- ``gelu_backward_colsum``: ``g = dy * gelu'(h)``, the MLP's up-projection gradient.
- ``cat_colsum``: ``g = cat([dq, dk, dv], -1)``, a fused qkv projection's gradient, read
  piece by piece where attention's backward wrote it (transposed heads included).

Each program keeps a float32 row of column sums of the rows it walks, as the readers see them
(rounded to ``g``'s dtype); one ``column_sum`` launch adds the programs' rows. The sums equal
Inductor's to float32 rounding (``tests/kernels/test_bias_grad.py``).
"""

from __future__ import annotations

import math

import torch

from fsg._src.kernels._common import RowTiling, use_triton
from fsg._src.kernels.column_sum import column_sum
from fsg._src.kernels.float8_cast import _rows_of
from fsg._src.kernels.float8_cast_kernel import APPROXIMATIONS as APPROXIMATIONS
from fsg._src.kernels.float8_cast_kernel import launch

# programs over the rows (each keeps one float32 row of column sums): few enough that the
# partial rows cost little to write and add up, enough to keep every SM's loads in flight
PROGRAMS = 512


def tiling(M: int, C: int) -> RowTiling:
    """One row a tile, ``PROGRAMS`` programs walking the rows (``RowTiling``'s warps: one per
    512 columns, 4 to 16)."""
    return RowTiling(M, C, rows=1, iters=max(1, math.ceil(M / PROGRAMS)))


def _colsum_reference(g: torch.Tensor) -> torch.Tensor:
    return g.reshape(-1, g.shape[-1]).float().sum(0)


@torch.library.custom_op("fsg::gelu_backward_colsum", mutates_args=())
def gelu_backward_colsum(dy: torch.Tensor, h: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, colsum)``: ``g = aten.gelu_backward(dy, h, approximate)`` (``[..., N]``, dy's
    dtype, contiguous) and the float32 sums of its ``[M, N]`` rows' columns, in one read of
    ``dy`` and ``h``."""
    if not use_triton(dy) or not dy.numel():
        g = torch.ops.aten.gelu_backward.default(dy, h, approximate=approximate)
        return g, _colsum_reference(g)
    N = dy.shape[-1]
    dy_MN, h_MN = dy.reshape(-1, N).contiguous(), h.reshape(-1, N).contiguous()
    t = tiling(dy_MN.shape[0], N)
    part = torch.empty((t.programs, N), dtype=torch.float32, device=dy.device)
    g_MN = torch.empty_like(dy_MN)
    launch([dy_MN], h_MN, g_MN, None, None, part, f"gelu_backward:{approximate}", t)
    return g_MN.reshape(dy.shape), column_sum(part)


@torch.library.custom_op("fsg::cat_colsum", mutates_args=())
def cat_colsum(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, colsum)``: ``g = cat(xs, -1)`` of two or three pieces of one shape ``[..., C]``
    (contiguous) and the float32 sums of its ``[M, N]`` rows' columns, reading each piece
    once where it lies (strided pieces too)."""
    if not use_triton(xs[0]) or not xs[0].numel():
        g = torch.cat(xs, -1)
        return g, _colsum_reference(g)
    pieces = [_rows_of(x) for x in xs]
    (M, C), N = pieces[0].shape, xs[0].shape[-1] * len(xs)
    t = tiling(M, C)
    part = torch.empty((t.programs, N), dtype=torch.float32, device=xs[0].device)
    g_MN = torch.empty((M, N), dtype=xs[0].dtype, device=xs[0].device)
    launch(pieces, None, g_MN, None, None, part, "identity", t)
    return g_MN.reshape(*xs[0].shape[:-1], N), column_sum(part)


@gelu_backward_colsum.register_fake
def _(dy, h, approximate):
    f32 = torch.empty((dy.shape[-1],), dtype=torch.float32, device=dy.device)
    return torch.empty(dy.shape, dtype=dy.dtype, device=dy.device), f32


@cat_colsum.register_fake
def _(xs):
    N = xs[0].shape[-1] * len(xs)
    g = torch.empty((*xs[0].shape[:-1], N), dtype=xs[0].dtype, device=xs[0].device)
    return g, torch.empty((N,), dtype=torch.float32, device=xs[0].device)
