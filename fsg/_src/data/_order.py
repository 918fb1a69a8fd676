"""The global order of windows: a stateless permutation, and the rows of each global batch.

Window ``w`` of a source of ``N`` tokens cut into windows of ``T + 1`` tokens is tokens
``[w * T, w * T + T + 1)``: consecutive windows overlap by the one token that is the last
target of the first, so every token position in ``[0, num_windows * T)`` is an input exactly
once per epoch (nanoGPT's and llm.c's layout).

The windows are served as one stream: epoch ``e`` serves ``permutation(seed, e)`` over all
windows, then epoch ``e + 1`` continues it (a batch may straddle two epochs; no window is
dropped). Position ``p`` of epoch ``e`` is window ``permute(p, seed, e)``, a keyed Feistel
bijection on ``[0, 2^2h) >= num_windows`` with cycle walking (Black & Rogaway, "Ciphers with
arbitrary finite domains", 2002): computed for any index without a table, so each rank
computes only its own rows and the sequence depends on nothing but ``(seed, epoch, position)``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

_ROUNDS = 6
_MULT = 0x5BD1E995  # < 2^31: with a 31-bit operand the product fits in int64
_MASK64 = (1 << 64) - 1


class Cursor(NamedTuple):
    """A position in the window stream: ``epoch`` and the index ``position`` within it."""

    epoch: int
    position: int


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _round_keys(seed: int, epoch: int) -> list[int]:
    key = _splitmix64((seed & _MASK64) ^ _splitmix64(epoch & _MASK64))
    keys = []
    for _ in range(_ROUNDS):
        key = _splitmix64(key)
        keys.append(key & 0x7FFFFFFF)
    return keys


def _feistel(x: np.ndarray, half: int, keys: list[int]) -> np.ndarray:
    mask = (1 << half) - 1
    left, right = x >> half, x & mask
    for k in keys:
        h = (right ^ k) * _MULT  # right < 2^31 and k < 2^31: no int64 overflow
        h = h ^ (h >> 29)
        left, right = right, (left ^ (h + k)) & mask
    return (left << half) | right


def permute(index: torch.Tensor, num: int, *, seed: int, epoch: int) -> torch.Tensor:
    """The windows at positions ``index`` (int64, each in ``[0, num)``) of epoch ``epoch``:
    a bijection of ``[0, num)`` chosen by ``(seed, epoch)``.

    Example:
      >>> w = permute(torch.arange(10), 10, seed=0, epoch=0)
      >>> sorted(w.tolist()) == list(range(10))
      True
    """
    if num <= 1:
        return torch.zeros_like(index)
    half = max(1, ((num - 1).bit_length() + 1) // 2)  # domain 2^(2 half) in [num, 4 num)
    if half > 31:
        raise ValueError(f"permute: {num} windows is more than this permutation's 2^62")
    keys = _round_keys(seed, epoch)
    # numpy, not torch: a batch is a few dozen indices, and numpy's per-op cost is ~10x lower
    out = _feistel(index.cpu().numpy().astype(np.int64), half, keys)
    outside = out >= num
    while outside.any():  # cycle walking: re-encrypt until inside [0, num)
        out[outside] = _feistel(out[outside], half, keys)
        outside = out >= num
    return torch.from_numpy(out)


def windows(cursor: Cursor, count: int, num: int, *, seed: int, skip: int = 0) -> torch.Tensor:
    """The ``count`` windows at stream positions ``skip, skip + 1, ...`` after ``cursor``
    (``[count]`` int64), crossing into the next epochs as needed."""
    stream = cursor.position + skip + torch.arange(count, dtype=torch.int64)
    first, last = cursor.epoch + int(stream[0]) // num, cursor.epoch + int(stream[-1]) // num
    if first == last:  # the common case: one epoch
        return permute(stream % num, num, seed=seed, epoch=first)
    epochs, index = cursor.epoch + stream // num, stream % num
    out = torch.empty_like(index)
    for e in range(first, last + 1):
        here = epochs == e
        out[here] = permute(index[here], num, seed=seed, epoch=e)
    return out


def advance(cursor: Cursor, count: int, num: int) -> Cursor:
    """The cursor ``count`` windows after ``cursor``."""
    stream = cursor.position + count
    return Cursor(cursor.epoch + stream // num, stream % num)


def rank_windows(cursor: Cursor, batch_size: int, num: int, *, seed: int, rank: int, num_ranks: int) -> torch.Tensor:
    """The windows of data rank ``rank``'s rows of the global batch at ``cursor``: rows
    ``[rank * b, (rank + 1) * b)`` with ``b = batch_size / num_ranks``, the block
    ``Shard(0)`` gives that rank."""
    local = batch_size // num_ranks
    return windows(cursor, local, num, seed=seed, skip=rank * local)
