"""A weight's two rowwise FP8 copies, one for each layout the matmuls read, from its float32
master in two launches: the float8 pass's op for a weight that both the forward matmul and the
grad-input matmul read in FP8 (``passes/float8/weights.py``, ``Fusions.fp8_weights``).

Shape legend: N the weight's rows (a linear layer's outputs), K its columns (its inputs).

A linear layer ``Y = X @ W.T`` under rowwise scaling reads ``W`` in FP8 twice: the forward
contracts over K (a scale per row of ``W``), the grad-input ``dX = dY @ W`` over N (a scale
per column: the rows of ``W.T``). Left unfused, the step casts the float32 master to the
compute dtype (``fsg::cast_flat``, one write of ``W`` in bf16 kept until the backward), and
Inductor reduces that copy's rows and casts it for the forward, then reduces its columns and
casts its transpose in the backward: ~14 bytes of traffic an element. Here one launch reads
the master once for both maxima (each tile's row and column maxima folded by atomic max into
one float32 buffer of ``N + K``) and a second reads it again and writes both FP8 copies and
their inverse scales: ~10 bytes an element, and no compute-dtype copy of ``W`` in memory.

The quantities are the unfused graph's (``Quantizer.rowwise_operand``): the values are the
master rounded to the compute dtype (``round_to``) first, ``scale = fp8_max / max(amax,
eps)`` per row of ``W`` and per row of ``W.T``, ``q = saturate(w * scale)``, and
``_scaled_mm`` takes ``1 / scale``.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import tl, triton, use_triton
from fsg._src.kernels.fp8.cast import E4M3, EPS, rowwise_fp8_reference
from fsg._src.kernels.fp8.cast_kernel import saturate, scale_of

ROUNDS = {None: 0, torch.bfloat16: 1, torch.float16: 2}  # what the master is rounded to first
SOURCES = (torch.float32, torch.bfloat16, torch.float16)  # the weights the kernel reads
# a program's tile: 32-128 rows and columns at 4 warps all ran alike on an H100
# (benchmarks/fp8_cast.py --only weight --sweep; benchmarks/RESULTS.md)
BLOCK_N, BLOCK_K, NUM_WARPS = 64, 64, 4


@triton.jit
def _tile(w_ptr, rows, cols, mask, s0, s1, ROUND: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_K]`` tile of ``w`` in float32 (0 where masked), rounded to the
    compute dtype first where ``ROUND`` says (1: bfloat16, 2: float16)."""
    g = tl.load(w_ptr + rows[:, None] * s0 + cols[None, :] * s1, mask=mask, other=0.0)
    if ROUND == 1:
        g = g.to(tl.bfloat16)
    elif ROUND == 2:
        g = g.to(tl.float16)
    return g.to(tl.float32)


@triton.jit
def _weight_amax_kernel(
    w_ptr, amax_ptr, N, K, s0, s1, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """Each tile's row and column maxima of ``|w|`` folded into ``amax`` (zeroed, ``N + K``:
    the rows' then the columns') by atomic max (exact in any order)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < N, cols < K
    a = tl.abs(_tile(w_ptr, rows, cols, row_ok[:, None] & col_ok[None, :], s0, s1, ROUND))
    tl.atomic_max(amax_ptr + rows, tl.max(a, axis=1), mask=row_ok, sem="relaxed")
    tl.atomic_max(amax_ptr + N + cols, tl.max(a, axis=0), mask=col_ok, sem="relaxed")


@triton.jit
def _weight_cast_kernel(
    w_ptr, amax_ptr, q_ptr, inv_ptr, qt_ptr, inv_t_ptr, N, K, s0, s1, fp8_max, eps,
    ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A tile's FP8 copies: scaled by its rows' maxima into ``q`` (``[N, K]``), by its columns'
    into ``qt`` (``[K, N]``, the transpose); the first column of tiles writes the rows' inverse
    scales, the first row of tiles the columns'."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < N, cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    g = _tile(w_ptr, rows, cols, mask, s0, s1, ROUND)
    scale = scale_of(tl.load(amax_ptr + rows, mask=row_ok, other=0.0), eps, fp8_max)
    scale_t = scale_of(tl.load(amax_ptr + N + cols, mask=col_ok, other=0.0), eps, fp8_max)
    q = saturate(g, scale[:, None], fp8_max)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    qt = tl.trans(saturate(g, scale_t[None, :], fp8_max))
    tl.store(qt_ptr + cols[:, None] * N + rows[None, :], qt.to(qt_ptr.dtype.element_ty), mask=tl.trans(mask))
    if pid_k == 0:
        tl.store(inv_ptr + rows, 1.0 / scale, mask=row_ok)
    if pid_n == 0:
        tl.store(inv_t_ptr + cols, 1.0 / scale_t, mask=col_ok)


def launch(w_NK, round_to, amax, q_NK, inv_N, qt_KN, inv_K, block: tuple[int, int] = (BLOCK_N, BLOCK_K)) -> None:
    """Writes into the given outputs (``amax``: float32 ``[N + K]``, zeroed). ``q_NK`` and
    ``qt_KN`` are scaled for ``float8_e4m3fn`` whatever their dtype (the CPU tests pass
    float32: the interpreter's FP8 conversion is wrong)."""
    N, K = w_NK.shape
    grid = (triton.cdiv(N, block[0]), triton.cdiv(K, block[1]))
    meta = {"ROUND": ROUNDS[round_to], "BLOCK_N": block[0], "BLOCK_K": block[1], "num_warps": NUM_WARPS}
    _weight_amax_kernel[grid](w_NK, amax, N, K, *w_NK.stride(), **meta)
    fp8_max = float(torch.finfo(E4M3).max)
    _weight_cast_kernel[grid](w_NK, amax, q_NK, inv_N, qt_KN, inv_K, N, K, *w_NK.stride(), fp8_max, EPS, **meta)


def weight_fp8_reference(w: torch.Tensor, round_to: torch.dtype | None):
    """``(q [N, K], inv [N, 1], qt [K, N], inv_t [K, 1])`` in plain torch: the unfused graph's
    casts of ``w`` (rounded to ``round_to`` first, if given) and of its transpose."""
    g = (w if round_to is None else w.to(round_to)).float()
    q, inv, _, _ = rowwise_fp8_reference(g)
    qt, inv_t, _, _ = rowwise_fp8_reference(g.t().contiguous())  # (row-major, as the op's outputs are)
    return q.contiguous(), inv, qt, inv_t


@torch.library.custom_op("fsg::weight_fp8", mutates_args=())
def weight_fp8(
    w: torch.Tensor, round_to: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rowwise ``float8_e4m3fn`` copies of 2-D ``w`` (rounded to ``round_to`` first, if
    given: the master's cast to the compute dtype) and of its transpose, both row-major, with
    their float32 inverse scales: ``(q [N, K], inv [N, 1], qt [K, N], inv_t [K, 1])``."""
    if w.dim() != 2 or round_to not in ROUNDS or (round_to is not None and w.dtype != torch.float32):
        raise ValueError(f"fsg::weight_fp8 takes a 2-D weight (and round_to a 16-bit dtype of a float32 one), "
                         f"got {tuple(w.shape)} {w.dtype}, round_to={round_to}")  # fmt: skip
    if not use_triton(w) or w.dtype not in SOURCES or not w.numel():
        return weight_fp8_reference(w, round_to)
    (N, K), f32 = w.shape, {"dtype": torch.float32, "device": w.device}
    amax = torch.zeros(N + K, **f32)
    q, qt = torch.empty((N, K), dtype=E4M3, device=w.device), torch.empty((K, N), dtype=E4M3, device=w.device)
    inv, inv_t = torch.empty((N, 1), **f32), torch.empty((K, 1), **f32)
    launch(w, round_to, amax, q, inv, qt, inv_t)
    return q, inv, qt, inv_t


@weight_fp8.register_fake
def _(w, round_to):
    (N, K), f32 = w.shape, {"dtype": torch.float32, "device": w.device}
    return (
        torch.empty((N, K), dtype=E4M3, device=w.device), torch.empty((N, 1), **f32),
        torch.empty((K, N), dtype=E4M3, device=w.device), torch.empty((K, 1), **f32),
    )  # fmt: skip
