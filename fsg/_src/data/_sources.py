"""Token sources: a flat sequence of token ids the loader cuts into ``[T + 1]`` windows.

A source has a ``name`` (for error messages), a length, and ``rows(starts, length)``: the
``[len(starts), length]`` int64 block of the windows starting at ``starts``. ``TokenFile``
maps a file (never reading past its end: the map has exactly the file's token count);
``Tokens`` wraps an in-memory 1-d tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import numpy as np
import torch

from fsg._src.data._formats import read_layout
from fsg._src.errors import DataError


class TokenFile:
    """A token file (nanoGPT raw ``uint16`` or llm.c's headed format), memory-mapped.

    Args:
      path: the file.
      format: ``"auto"`` (default: llm.c when the file starts with its magic number),
        ``"llmc"`` or ``"nanogpt"``.

    Raises:
      fsg.data.DataError: the file is missing, empty, odd-sized, truncated or wrongly headed.

    Example:
      >>> tokens = fsg.data.TokenFile("train.bin")  # doctest: +SKIP
      >>> len(tokens), tokens.format  # doctest: +SKIP
      (338025, 'llmc')
    """

    def __init__(self, path: str | Path, *, format: str = "auto"):
        self.path = Path(path)
        layout = read_layout(self.path, format)
        self.format = layout.format
        self.name = str(self.path)
        self._map = np.memmap(self.path, dtype=layout.dtype, mode="r", offset=layout.offset, shape=(layout.count,))

    def __len__(self) -> int:
        return self._map.shape[0]

    def __repr__(self) -> str:
        return f"TokenFile({self.name!r}, format={self.format!r}, tokens={len(self)})"

    def rows(self, starts: np.ndarray, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The windows ``[s, s + length)`` for ``s`` in ``starts``, as int64 ``[len(starts), length]``
        (written into ``out`` when given, e.g. a pinned buffer)."""
        _check_bounds(self, starts, length)
        direct = out is not None and out.dtype == torch.int64 and out.is_contiguous()
        block = out.numpy() if direct else np.empty((len(starts), length), dtype=np.int64)
        # The map seen as its overlapping windows (a read-only view, no copy): one row gather and
        # one cast, both numpy loops that release the GIL, so several workers gather at once (a
        # Python loop over rows held it: two threads ran at a third of one's rate).
        windows = np.lib.stride_tricks.as_strided(
            self._map, shape=(max(len(self) - length + 1, 0), length), strides=self._map.strides * 2, writeable=False
        )
        np.copyto(block, windows[np.asarray(starts, dtype=np.intp)], casting="unsafe")
        if direct:
            return out
        rows = torch.from_numpy(block)
        return rows if out is None else out.copy_(rows)


class Tokens:
    """In-memory token ids (a 1-d integer tensor) as a source.

    Args:
      tokens: a 1-d integer tensor (any device; kept on the CPU).
      name: what error messages call it.

    Example:
      >>> src = fsg.data.Tokens(torch.arange(100))
      >>> len(src)
      100
    """

    def __init__(self, tokens: torch.Tensor, *, name: str = "tokens"):
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.ndim != 1
            or tokens.is_floating_point()
            or tokens.is_complex()
        ):
            got = f"{tokens.dtype}{list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise DataError(f"{name}: in-memory tokens must be a 1-d integer tensor; got {got}")
        if tokens.numel() == 0:
            raise DataError(f"{name}: in-memory tokens are empty; they hold no window")
        if int(tokens.min()) < 0:
            raise DataError(
                f"{name}: token ids are non-negative; got {int(tokens.min())} at index {int(tokens.argmin())}"
            )
        self._tokens = tokens.detach().cpu().to(torch.int64).contiguous()
        self.name = name

    def __len__(self) -> int:
        return self._tokens.shape[0]

    def __repr__(self) -> str:
        return f"Tokens({self.name!r}, tokens={len(self)})"

    def rows(self, starts: np.ndarray, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """As ``TokenFile.rows``."""
        _check_bounds(self, starts, length)
        if not len(starts):
            rows = torch.empty((0, length), dtype=torch.int64)
        else:  # a row gather out of the windows view [N - length + 1, length]: no index matrix
            rows = self._tokens.unfold(0, length, 1)[torch.from_numpy(np.asarray(starts, dtype=np.int64))]
        return rows if out is None else out.copy_(rows)


Source = Union[TokenFile, Tokens]


def _check_bounds(source, starts: np.ndarray, length: int) -> None:
    # The loader never asks past the end; this guards the contract for direct callers.
    if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + length > len(source)):
        raise DataError(
            f"{source.name}: a window [{int(starts.max())}, {int(starts.max()) + length}) reaches past the "
            f"end of its {len(source)} tokens"
        )


def as_source(data, *, format: str = "auto") -> Source:
    """``data`` as a source: a path opens a ``TokenFile``, a tensor becomes ``Tokens``."""
    if isinstance(data, (TokenFile, Tokens)):
        return data
    if isinstance(data, (str, Path)):
        return TokenFile(data, format=format)
    if isinstance(data, torch.Tensor):
        return Tokens(data)
    raise DataError(
        f"data must be a token file path, a 1-d integer tensor, or a fsg.data.TokenFile / Tokens; "
        f"got {type(data).__name__}"
    )
