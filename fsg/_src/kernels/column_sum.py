"""Column sums of a float32 matrix in one Triton launch, without a memset.

``x.sum(dim=0)`` of an ``[R, C]`` float32 matrix whose rows are partial sums (R of them: e.g.
the 1024 partials Inductor's mix-order reductions leave per column) runs in torch as a
reduction split over blocks, which zeroes its semaphores with a memset before each launch. In a
replayed CUDA graph that memset is a node of its own, and each memset/kernel hand-over costs
1.5-3 us on an H200, more than the sum itself (GPT-2 124M: 56 such sums a step, ~0.65 ms;
benchmarks/RESULTS.md). Here each program owns ``BLOCK_C`` columns and walks every row in
order, so the sum is one kernel, deterministic, with no workspace and no atomics.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import tl, triton, use_triton

BLOCK_C = 16  # columns a program: 48 programs for 768 columns, 192 for 3072
MAX_BLOCK_R = 1024  # rows a program holds at once (16K float32 over 8 warps: 64 registers a thread)


@triton.jit
def _column_sum_kernel(x_ptr, out_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for start in range(0, R, BLOCK_R):
        r = start + rows
        mask = (r < R)[:, None] & (cols < C)[None, :]
        acc += tl.load(x_ptr + r.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < C)


def column_sum(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.sum(dim=0)`` of a 2-D float32 ``x`` (float32, ``[C]``): one Triton launch on CUDA
    (the rows summed in order, the same on every call); torch's sum elsewhere, and for any
    other dtype or rank. With ``out`` (``C`` elements of any shape and dtype: a slice of a
    ``cat``'s output), the sums are written there and ``out`` is returned."""
    if not (x.dim() == 2 and x.dtype == torch.float32 and x.numel() > 0 and use_triton(x)):
        sums = x.sum(dim=0)
        return sums if out is None else out.copy_(sums.reshape(out.shape))
    x = x.contiguous()
    R, C = x.shape
    if out is not None and out.numel() != C:
        raise ValueError(f"column_sum: out has {out.numel()} elements for {C} column sums")
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    result = out if direct else torch.empty(C, dtype=torch.float32, device=x.device)
    block_r = min(MAX_BLOCK_R, triton.next_power_of_2(R))
    _column_sum_kernel[(triton.cdiv(C, BLOCK_C),)](x, result, R, C, BLOCK_R=block_r, BLOCK_C=BLOCK_C, num_warps=8)
    return result if out is None or direct else out.copy_(result.reshape(out.shape))
