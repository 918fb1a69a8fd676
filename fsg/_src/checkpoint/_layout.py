"""Which part of a global tensor each rank holds, as boxes of ``[start, stop)`` per dim."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

Box = tuple[tuple[int, int], ...]


class LocalPiece(NamedTuple):
    """A rank's piece of a leaf: its box in the global tensor, and whether this rank is the
    one that writes it (a replicated piece is written once)."""

    box: Box
    writer: bool


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def local_piece(t: torch.Tensor) -> LocalPiece:
    """The box this rank holds of ``t`` (the whole tensor for a plain tensor)."""
    if not isinstance(t, DTensor):
        return LocalPiece(full_box(tuple(t.shape)), True)
    mesh = t.device_mesh
    coords = mesh.get_coordinate()
    box = [list(b) for b in full_box(tuple(t.shape))]
    writer = True
    for axis, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            lo, hi = box[placement.dim]
            n = mesh.size(axis)
            # torch.tensor_split semantics, as DTensor shards: the first chunks are larger.
            base, extra = divmod(hi - lo, n)
            c = coords[axis]
            start = lo + c * base + min(c, extra)
            box[placement.dim] = [start, start + base + (1 if c < extra else 0)]
        elif isinstance(placement, Replicate):
            writer = writer and coords[axis] == 0
        else:
            raise ValueError(f"cannot checkpoint a tensor with placement {placement}; redistribute it first")
    return LocalPiece(tuple((a, b) for a, b in box), writer)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def slices(region: Box, within: Box) -> tuple[slice, ...]:
    """Index of ``region`` inside a tensor that holds the box ``within``."""
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(region, within))
