"""Which part of a global tensor each rank holds, as boxes of ``[start, stop)`` per dim."""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsg._src.checkpoint import _io
from fsg._src.errors import CheckpointError

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


def check_plain_replicated(paths: list[str], leaves: list[Any], world: int, group=None) -> None:
    """Raises ``CheckpointError`` on every rank if a plain (non-DTensor) tensor leaf differs
    between ranks: a multi-rank save holds one copy of it, which would silently drop the
    others. One ``all_gather_object`` of crc32s; nothing on one rank or without a plain tensor."""
    plain = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor)]
    if world == 1 or not plain:
        return
    structure = zlib.crc32("\n".join(paths).encode())
    mine = [zlib.crc32(_io.host_bytes(leaves[i])) for i in plain]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (structure, mine), group=group)
    others = [r for r, (s, _) in enumerate(every) if s != structure]
    if others:
        raise CheckpointError(
            f"the ranks save trees of different leaves (ranks {others} hold other paths than this rank's "
            f"{len(paths)}); every rank saves the same tree. A pipeline step's ranks each hold a part of the "
            f"state: save it with step.save(path, state), which writes the whole tree"
        )
    every = [crcs for _, crcs in every]
    for k, i in enumerate(plain):
        values = [crcs[k] for crcs in every]
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise CheckpointError(
                f"{paths[i]} is a plain tensor that differs between ranks (rank 0 and ranks {differ} hold other "
                f"values); a checkpoint saves a plain tensor once, as a replicated value. Make it equal on every "
                f"rank, or make it a DTensor sharded over the ranks whose values differ."
            )


def restore_leaf(entry: dict, like: torch.Tensor, reader: _io.PieceReader, where: str) -> torch.Tensor:
    """One leaf of ``like``'s placement (this rank's piece) read from the pieces that overlap it."""
    target = local_piece(like).box if isinstance(like, DTensor) else full_box(tuple(like.shape))
    dtype = _io.DTYPES[entry["dtype"]]
    out = torch.empty([hi - lo for lo, hi in target], dtype=dtype)
    filled, seen = 0, set()
    for piece in entry["pieces"]:
        box = tuple(tuple(b) for b in piece["box"])
        if box in seen:  # older saves wrote a plain tensor once per rank: read one copy
            continue
        seen.add(box)
        region = intersect(box, target) if box else ()
        if region is None:
            continue  # this rank does not need that piece: its bytes are never read
        args = (piece["file"], piece["offset"], piece["nbytes"], piece["crc32"], where)
        if box == target:  # the piece is exactly what this rank holds: read it in place
            reader.read_into(*args, _io.host_bytes(out))
            filled += out.numel()
            continue
        src = reader.read(*args).view(dtype).reshape([hi - lo for lo, hi in box])
        part = src[slices(region, box)]
        out[slices(region, target)] = part
        filled += part.numel()
    if filled != out.numel():
        raise CheckpointError(f"{where}: the checkpoint's pieces cover {filled} of {out.numel()} elements")
    if isinstance(like, DTensor):
        local = out.to(like.to_local().device)
        return DTensor.from_local(
            local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    return out if like.device.type == "meta" else out.to(like.device)
