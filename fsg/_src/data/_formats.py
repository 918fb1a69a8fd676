"""Flat token files: nanoGPT's raw ``uint16`` ``.bin`` and llm.c's headed format.

- **nanoGPT** (``data/*/prepare.py``): the token ids as ``uint16``, nothing else; the token
  count is the file size / 2.
- **llm.c** (``dev/data/data_common.py``): a header of 256 ``int32`` (``[0]`` the magic
  20240520, ``[1]`` the version: 1 for ``uint16`` tokens (GPT-2), 2 for ``uint32`` (Llama 3),
  ``[2]`` the token count), then the tokens.

``read_layout`` checks a file against its format before anything is mapped: the header, and
that the size is exactly what the header (or the dtype) implies, so a truncated file is refused
rather than read past its end.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from fsg._src.errors import DataError

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
LLMC_DTYPES = {1: np.uint16, 2: np.uint32}  # header version -> token dtype
FORMATS = ("auto", "llmc", "nanogpt")


class Layout(NamedTuple):
    """Where the tokens of a file lie: byte offset, count and dtype, and the format name."""

    format: str
    offset: int
    count: int
    dtype: type


def _header(path: Path, size: int) -> np.ndarray | None:
    if size < LLMC_HEADER_BYTES:
        return None
    return np.fromfile(path, dtype=np.int32, count=LLMC_HEADER_INTS)


def read_layout(path: str | Path, format: str = "auto") -> Layout:
    """The ``Layout`` of the token file ``path``, checked against ``format``.

    Args:
      path: a token file.
      format: ``"llmc"``, ``"nanogpt"``, or ``"auto"`` (llm.c when the file starts with its
        magic number, else nanoGPT's raw ``uint16``).

    Returns:
      ``Layout(format, offset, count, dtype)``.

    Raises:
      DataError: the file is missing, empty, odd-sized, truncated, or its header is wrong.
    """
    path = Path(path)
    if format not in FORMATS:
        raise DataError(f"token file {path}: format must be one of {FORMATS}; got {format!r}")
    if not path.is_file():
        raise DataError(
            f"token file {path} does not exist (or is not a file); run `python -m fsg.data prepare` to make one"
        )
    size = path.stat().st_size
    header = _header(path, size)
    is_llmc = header is not None and int(header[0]) == LLMC_MAGIC
    if format == "llmc" or (format == "auto" and is_llmc):
        return _llmc_layout(path, size, header)
    if size == 0:
        raise DataError(f"token file {path} is empty (0 bytes); it holds no tokens")
    if size % 2:
        raise DataError(
            f"token file {path} has {size} bytes, an odd number, but nanoGPT's format is uint16 tokens "
            f"(2 bytes each): the file is truncated or not a token file"
        )
    return Layout("nanogpt", 0, size // 2, np.uint16)


def _llmc_layout(path: Path, size: int, header: np.ndarray | None) -> Layout:
    if header is None:
        raise DataError(
            f"token file {path} has {size} bytes, fewer than llm.c's {LLMC_HEADER_BYTES}-byte header: "
            f"truncated, or a raw nanoGPT file (pass format='nanogpt')"
        )
    magic, version, count = (int(v) for v in header[:3])
    if magic != LLMC_MAGIC:
        raise DataError(
            f"token file {path}: header magic is {magic}, llm.c's is {LLMC_MAGIC}; not an llm.c token "
            f"file (a raw nanoGPT file takes format='nanogpt')"
        )
    if version not in LLMC_DTYPES:
        raise DataError(f"token file {path}: header version is {version}; llm.c's are 1 (uint16 tokens) and 2 (uint32)")
    dtype = LLMC_DTYPES[version]
    itemsize = np.dtype(dtype).itemsize
    expected = LLMC_HEADER_BYTES + count * itemsize
    if count <= 0 or size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(
            f"token file {path}: header says {count} tokens of {itemsize} bytes ({expected} bytes with the "
            f"header) but the file has {size} bytes: {what}; prepare it again"
        )
    return Layout("llmc", LLMC_HEADER_BYTES, count, dtype)


def write_tokens(path: str | Path, tokens, *, format: str = "llmc") -> Path:
    """Writes token ids to ``path`` as an llm.c or nanoGPT token file, atomically.

    Args:
      path: the file to write (its folder must exist).
      tokens: a 1-d sequence of non-negative ints (list, numpy array or tensor).
      format: ``"llmc"`` (default: 256-int32 header, then ``uint16`` tokens, or ``uint32``
        when an id passes 65535) or ``"nanogpt"`` (raw ``uint16``).

    Returns:
      The path written.

    Example:
      >>> fsg.data.write_tokens(tmp / "tiny.bin", [1, 2, 3, 4])  # doctest: +SKIP
    """
    path = Path(path)
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens).reshape(-1).astype(np.int64)
    if array.size == 0:
        raise DataError(f"write_tokens({path}): no tokens to write")
    low, high = int(array.min()), int(array.max())
    wide = high > np.iinfo(np.uint16).max
    if low < 0 or high > np.iinfo(np.uint32).max or (wide and format == "nanogpt"):
        limit = 65535 if format == "nanogpt" else 2**32 - 1
        raise DataError(
            f"write_tokens({path}): token ids must lie in [0, {limit}] for format {format!r}; got [{low}, {high}]"
        )
    if format not in ("llmc", "nanogpt"):
        raise DataError(f"write_tokens({path}): format must be 'llmc' or 'nanogpt'; got {format!r}")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if format == "llmc":
            header = np.zeros(LLMC_HEADER_INTS, dtype=np.int32)
            header[:3] = (LLMC_MAGIC, 2 if wide else 1, array.size)
            f.write(header.tobytes())
        f.write(array.astype(np.uint32 if wide else np.uint16).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
