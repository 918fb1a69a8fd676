"""Device tables for multi-tensor launches: one Triton launch over many tensors.

A multi-tensor kernel reads each tensor's base address from an int64 table and maps each
program to ``(tensor, offset)`` with two block tables. Tables are uploaded from pinned memory
without a host sync. While a CUDA graph is captured nothing can be uploaded or pinned, so the
warm-up run before a capture (``capture_warmup``) sets aside, per call site, a pinned host
buffer and a device table; the capture writes the addresses (fixed in the graph's memory pool)
into the host buffer and records the host-to-device copy, which every replay repeats. What a
graph reads is kept alive as long as the graph (``keep_alive``).
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import capturing, in_capture_warmup, keep_alive

MAX_CACHED = 256  # entries per cache: a step on a mesh launches one update per gradient bucket


def upload(values, dtype, device) -> torch.Tensor:
    """A host list as a device tensor, copied from pinned memory without a host sync (the
    caching host allocator keeps the pinned buffer until the copy is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Blocks:
    """Which ``(tensor, offset)`` each program of a launch covers, ``block`` elements each
    (a block never spans two tensors), and each tensor's element count."""

    def __init__(self, numels: list[int], block: int, device: torch.device):
        counts = [-(-n // block) for n in numels]
        self.num_blocks = sum(counts)
        self.numels = upload(numels, torch.int64, device)
        self.block_tensor = upload([i for i, n in enumerate(counts) for _ in range(n)], torch.int32, device)
        self.block_offset = upload([j * block for n in counts for j in range(n)], torch.int64, device)


class _ForCapture:
    """A pinned host buffer and a device table of ``count`` addresses, set aside by a warm-up
    for the capture after it."""

    def __init__(self, count: int, device: torch.device, held: tuple):
        self.held = held  # tables the graph reads besides this one: a cache eviction must not free them
        self.host = torch.empty(count, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = torch.empty(count, dtype=torch.int64, device=device)

    def fill(self, tensors) -> torch.Tensor:
        self.host.copy_(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64))
        self.device.copy_(self.host, non_blocking=True)  # recorded: replayed from the pinned buffer
        return self.device


_ADDRESSES: dict[tuple, tuple[list[int], torch.Tensor]] = {}
_FOR_CAPTURE: dict[tuple, list[_ForCapture]] = {}


def addresses(tensors, site: tuple, held: tuple = ()) -> tuple[torch.Tensor | None, tuple]:
    """The device table of ``tensors``' addresses for the launch at ``site`` (a key naming the
    call), uploaded again only when a tensor moved, and the static tables ``held`` to launch
    with. While capturing: the table a warm-up set aside for ``site`` (in call order) and the
    tables that warm-up held, both kept alive with the graph; ``(None, held)`` when no warm-up
    set one aside (the caller then launches without tables)."""
    device = tensors[0].device
    if capturing(device):
        waiting = _FOR_CAPTURE.get(site)
        if not waiting:
            return None, held
        captured = waiting.pop(0)
        keep_alive(captured)
        return captured.fill(tensors), captured.held
    if in_capture_warmup():
        if sum(map(len, _FOR_CAPTURE.values())) >= MAX_CACHED:  # warm-ups whose capture failed
            _FOR_CAPTURE.clear()
        _FOR_CAPTURE.setdefault(site, []).append(_ForCapture(len(tensors), device, held))
    ptrs = [t.data_ptr() for t in tensors]
    cached = _ADDRESSES.get(site)
    if cached is None or cached[0] != ptrs:
        if len(_ADDRESSES) >= MAX_CACHED:
            _ADDRESSES.clear()
        cached = _ADDRESSES[site] = (ptrs, upload(ptrs, torch.int64, device))
    return cached[1], held


_BLOCKS: dict[tuple, Blocks] = {}


def blocks(numels: list[int], block: int, device: torch.device) -> Blocks | None:
    """The cached ``Blocks`` of these sizes; ``None`` while capturing when none was made
    before (nothing can be uploaded then)."""
    key = (tuple(numels), block, device)
    found = _BLOCKS.get(key)
    if found is None:
        if capturing(device):
            return None
        if len(_BLOCKS) >= MAX_CACHED:
            _BLOCKS.clear()
        found = _BLOCKS[key] = Blocks(numels, block, device)
    return found
