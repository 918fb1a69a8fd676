"""Files of a checkpoint: shard files of msgpack ``bin`` records, fsync, atomic commit."""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import torch

from fsg._src.errors import CheckpointError

# Every dtype a checkpoint holds, by the name it is stored under.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.complex128, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)}  # fmt: skip

COMMIT = "COMMIT"
META = "meta.msgpack"
_BIN32 = b"\xc6"  # msgpack bin 32: one type byte, a 4-byte big-endian length, the bytes
_MAX_PIECE = 2**32 - 1


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.msgpack"


def host_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``t`` in row-major order, as one host buffer."""
    host = t.detach().contiguous().cpu().reshape(-1)
    return memoryview(host.view(torch.uint8).numpy()) if host.numel() else memoryview(b"")


def write_records(f: BinaryIO, items: Iterable[tuple[Any, torch.Tensor]]) -> list[tuple[Any, int, int, int]]:
    """Writes each tensor as a msgpack ``bin`` record, one tensor in host memory at a time.

    Returns ``(key, offset, nbytes, crc32)`` per item; ``offset`` is where the tensor's bytes
    start (after the record header).
    """
    out = []
    pos = f.tell()
    for key, tensor in items:
        data = host_bytes(tensor)
        if data.nbytes > _MAX_PIECE:
            raise CheckpointError(f"{key}: a piece of {data.nbytes} bytes exceeds 4 GiB; shard it over more ranks")
        f.write(_BIN32 + struct.pack(">I", data.nbytes))
        pos += 5
        f.write(data)
        out.append((key, pos, data.nbytes, zlib.crc32(data)))
        pos += data.nbytes
    return out


def fsync_file(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_committed(path: Path) -> bool:
    return (path / COMMIT).is_file()


def commit(tmp: Path, final: Path) -> None:
    """Makes ``tmp`` the checkpoint ``final``: fsync, rename, then the commit marker.

    A crash before the rename leaves only ``NAME.tmp``; after it but before the marker, a
    directory that readers treat as incomplete. Either way the previous checkpoint stands.
    """
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    with open(final / COMMIT, "wb") as f:
        f.write(b"ok\n")
        fsync_file(f)
    fsync_dir(final)


def remove(path: Path) -> None:
    """Deletes a checkpoint directory so that no crash can leave it looking complete: it is
    renamed to a ``.tmp`` name first (atomic), then deleted."""
    if not path.exists():
        return
    doomed = path if path.name.endswith(".tmp") else path.with_name(path.name + ".deleted.tmp")
    if doomed != path:
        os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class PieceReader:
    """Reads pieces from a checkpoint's shard files, checking size and checksum."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._files: dict[str, BinaryIO] = {}

    def _file(self, file: str, where: str) -> BinaryIO:
        f = self._files.get(file)
        if f is None:
            try:
                f = self._files[file] = open(self.directory / file, "rb")  # noqa: SIM115 - closed in close()
            except FileNotFoundError:
                raise CheckpointError(
                    f"{self.directory / file} is missing; it holds pieces of {where}. The checkpoint is "
                    f"incomplete: restore an earlier one."
                ) from None
        return f

    def read_into(self, file: str, offset: int, nbytes: int, crc: int, where: str, buffer: memoryview) -> None:
        """Reads a piece straight into ``buffer`` (``nbytes`` long), checking its checksum."""
        f = self._file(file, where)
        f.seek(offset)
        got = f.readinto(buffer) if nbytes else 0
        if got != nbytes:
            raise CheckpointError(
                f"{self.directory / file} is truncated: {where} needs bytes {offset}..{offset + nbytes} "
                f"but the file ends first. Restore an earlier checkpoint."
            )
        if zlib.crc32(buffer) != crc:
            raise CheckpointError(
                f"{self.directory / file} is corrupt: the checksum of {where} (bytes {offset}..{offset + nbytes}) "
                f"does not match. Restore an earlier checkpoint."
            )

    def read(self, file: str, offset: int, nbytes: int, crc: int, where: str) -> torch.Tensor:
        """Reads a piece into a new uint8 tensor."""
        out = torch.empty(nbytes, dtype=torch.uint8)
        self.read_into(file, offset, nbytes, crc, where, memoryview(out.numpy()))
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
