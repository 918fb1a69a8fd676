"""Sum of squares over many tensors in one launch: the global gradient norm's reduction.

Traced as plain torch, a global norm is one reduction kernel per tensor and a few more to
stack and sum them: ~180 launches and ~0.27 ms a step for a 125M Llama on an H200 (profile in
benchmarks/RESULTS.md). Here one multi-tensor launch per dtype writes each program's partial
sum (float32, ``BLOCK`` elements each, a block never spans two tensors) and one torch sum adds
the partials, in a fixed order: the result is deterministic, as the traced reduction is.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import HAS_TRITON, fused_ops_enabled, tl, triton, use_triton
from fsg._src.kernels._multi_tensor import addresses, blocks

BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def _sum_squares_kernel(addrs, numels, block_tensor, block_offset, partials, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.load(block_tensor + pid)
    offs = tl.load(block_offset + pid) + tl.arange(0, BLOCK)
    x_ptr = tl.load(addrs + i).to(tl.pointer_type(DTYPE))
    x = tl.load(x_ptr + offs, mask=offs < tl.load(numels + i), other=0.0).to(tl.float32)
    tl.store(partials + pid, tl.sum(x * x, axis=0))


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if HAS_TRITON else {}


def sum_squares_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``sum_k sum(t_k ** 2)`` in float32, one reduction per tensor (the traced definition)."""
    return torch.stack([torch.sum(t.float() * t.float()) for t in tensors]).sum()


def launch(tensors: list[torch.Tensor], block: int = BLOCK) -> torch.Tensor | None:
    """The sum of squares of ``tensors`` (one dtype, contiguous) as a 0-d float32 tensor, or
    ``None`` while capturing a CUDA graph that no warm-up prepared (nothing can be uploaded)."""
    device = tensors[0].device
    numels = [t.numel() for t in tensors]
    table, (found,) = addresses(
        tensors, ("sum_squares", tuple(numels), tensors[0].dtype, block), (blocks(numels, block, device),)
    )
    if table is None or found is None:
        return None
    partials = torch.empty(found.num_blocks, dtype=torch.float32, device=device)
    _sum_squares_kernel[(found.num_blocks,)](
        table, found.numels, found.block_tensor, found.block_offset, partials,
        DTYPE=_TL_DTYPES[tensors[0].dtype], BLOCK=block, num_warps=NUM_WARPS,
    )  # fmt: skip
    return partials.sum()


@torch.library.custom_op("fsg::sum_squares", mutates_args=())
def sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``sum_k sum(t_k ** 2)`` in float32 (0-d): one launch per dtype on CUDA."""
    if not use_triton(tensors[0]) or any(t.dtype not in _TL_DTYPES for t in tensors):
        return sum_squares_reference(tensors)
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault(t.dtype, []).append(t.contiguous())
    sums = [launch(group) for group in groups.values()]
    if any(s is None for s in sums):
        return sum_squares_reference(tensors)
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float32, device=tensors[0].device)


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` together (float32, 0-d), as ``fsg.optim.global_norm``
    defines it: with the op where fused ops run on these tensors (not on a mesh, where stage 2
    shards plain torch math), else the traced reduction."""
    if not tensors:
        return torch.zeros(())
    if fused_ops_enabled() and use_triton(tensors[0]) and not any(t.requires_grad for t in tensors):
        return torch.sqrt(sum_squares(tensors))
    return torch.sqrt(sum_squares_reference(tensors))


@sum_squares.register_fake
def _(tensors):
    return torch.empty((), dtype=torch.float32, device=tensors[0].device)
