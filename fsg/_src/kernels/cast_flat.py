"""Many tensors cast to one dtype in one Triton launch, into one flat buffer.

A step under ``Policy(compute=bfloat16)`` casts each float32 parameter where the forward
reads it: one small kernel each (GPT-2 124M: about 107 launches, 0.36 ms a step on an H200 for
the 0.74 GB they move; this op's one launch takes 0.21 ms).
``fsg::cast_flat(tensors, dtype)`` writes every tensor, cast, into one flat buffer in one
launch (each at an offset of ``flat_offsets``, aligned to ``ALIGN`` elements); the graph takes
each one's view of it (``passes/batch_casts.py``). Rounding is the cast's own (``.to(dtype)``),
bit for bit.

The launch reads the sources' addresses from a device table cached by those addresses: a
donated step passes the same state storages every call, so the table built before a CUDA-graph
capture is the one the graph reads (kept alive with it). A capture the table was not built
for casts tensor by tensor (``copy_``), which is capturable.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import HAS_TRITON, capturing, keep_alive, tl, triton, use_triton
from fsg._src.kernels._multi_tensor import MAX_CACHED, Blocks, upload

BLOCK = 2048  # elements a program
NUM_WARPS = 4
ALIGN = 128  # elements: every view starts 256-byte aligned in 16 bits (GEMM operands need 16)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if HAS_TRITON else {}


@triton.jit
def _cast_flat_kernel(
    src_addrs, numels, dst_starts, block_tensor, block_offset, dst_ptr, SRC: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    i = tl.load(block_tensor + pid)
    offs = tl.load(block_offset + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + i)
    src = tl.load(src_addrs + i).to(tl.pointer_type(SRC))
    x = tl.load(src + offs, mask=mask)
    tl.store(dst_ptr + tl.load(dst_starts + i) + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def flat_offsets(numels: list[int]) -> tuple[list[int], int]:
    """Where each tensor starts in the flat buffer (multiples of ``ALIGN``), and its size."""
    starts, end = [], 0
    for n in numels:
        starts.append(end)
        end += -(-n // ALIGN) * ALIGN
    return starts, end


class _Tables:
    def __init__(self, tensors, block: int):
        device = tensors[0].device
        numels = [t.numel() for t in tensors]
        starts, self.total = flat_offsets(numels)
        self.blocks = Blocks(numels, block, device)
        self.src = upload([t.data_ptr() for t in tensors], torch.int64, device)
        self.starts = upload(starts, torch.int64, device)


_TABLES: dict[tuple, _Tables] = {}


def _cast_each(tensors, out) -> None:
    for t, start in zip(tensors, flat_offsets([t.numel() for t in tensors])[0]):
        out[start : start + t.numel()].copy_(t.reshape(-1))


@torch.library.custom_op("fsg::cast_flat", mutates_args=())
def cast_flat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A flat 1-D ``dtype`` buffer holding each of ``tensors``, cast, from its ``flat_offsets``
    start, row-major: one launch when they are contiguous CUDA tensors of one dtype, else a
    ``copy_`` each."""
    if not tensors:
        raise ValueError("fsg::cast_flat needs at least one tensor")
    device = tensors[0].device
    key = (BLOCK, dtype, device, *((t.data_ptr(), t.numel(), t.dtype, t.is_contiguous()) for t in tensors))
    tables = _TABLES.get(key)  # found: these tensors took the launch before (every step after the first)
    if tables is None:
        if (not use_triton(tensors[0]) or tensors[0].dtype not in _TL_DTYPES or dtype not in _TL_DTYPES
                or any(t.dtype != tensors[0].dtype or t.device != device or not t.is_contiguous() for t in tensors)
                or capturing(device) or not sum(t.numel() for t in tensors)):  # fmt: skip
            # (while capturing without a warm-up's table nothing can be uploaded)
            out = torch.empty(flat_offsets([t.numel() for t in tensors])[1], dtype=dtype, device=device)
            _cast_each(tensors, out)
            return out
        if len(_TABLES) >= MAX_CACHED:
            _TABLES.clear()
        tables = _TABLES[key] = _Tables(tensors, BLOCK)
    out = torch.empty(tables.total, dtype=dtype, device=device)
    if capturing(device):
        keep_alive(tables)  # the graph reads them at every replay
    _cast_flat_kernel[(tables.blocks.num_blocks,)](
        tables.src, tables.blocks.numels, tables.starts, tables.blocks.block_tensor, tables.blocks.block_offset,
        out, SRC=_TL_DTYPES[tensors[0].dtype], BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


@cast_flat.register_fake
def _(tensors, dtype):
    return tensors[0].new_empty(flat_offsets([t.numel() for t in tensors])[1], dtype=dtype)
