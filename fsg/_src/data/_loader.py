"""``Loader``: each rank's rows of a deterministic, resumable sequence of global token batches.

Global batch ``i`` is the ``batch_size`` windows at stream positions ``[i B, (i + 1) B)`` of
the permuted window stream (``_order.py``): a pure function of the seed and the cursor
``(epoch, position)``, whatever the number of ranks. A data rank computes and reads only its
own block of rows. The cursor is the loader's whole state (``state_dict``), saved beside the
train state and restored onto any number of ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate

from fsg._src import checks
from fsg._src.data import _order
from fsg._src.data._order import Cursor
from fsg._src.data._prefetch import Prefetcher
from fsg._src.data._ranks import data_rank
from fsg._src.data._sources import as_source
from fsg._src.errors import DataError
from fsg._src.mesh import Mesh, P

STATE_KEYS = ("seed", "epoch", "position", "num_windows")


def _produce(source, *, seed: int, batch_size: int, seq_len: int, num: int, rank: int, num_ranks: int,
             vocab_size: int | None, dtype: torch.dtype, cursor: Cursor, pin: bool) -> tuple[torch.Tensor, Cursor]:  # fmt: skip
    """This rank's ``[B / R, T + 1]`` rows of the global batch at ``cursor``, and the next cursor."""
    windows = _order.rank_windows(cursor, batch_size, num, seed=seed, rank=rank, num_ranks=num_ranks)
    starts = (windows * seq_len).numpy()
    rows_BT = torch.empty((len(starts), seq_len + 1), dtype=dtype, pin_memory=pin)
    source.rows(starts, seq_len + 1, out=rows_BT)
    if vocab_size is not None:
        _check_vocab(source, rows_BT, starts, vocab_size)
    return rows_BT, _order.advance(cursor, batch_size, num)


def _produce_at(produce, start: Cursor, batch_size: int, num: int, index: int, pin: bool):
    """Batch ``index`` counted from ``start``: any one computed on its own, so workers can build
    different future batches at once (a module function, so that the threads hold no reference
    to the loader and ``Loader.__del__`` can stop them)."""
    return produce(cursor=_order.advance(start, index * batch_size, num), pin=pin)


def _describe(start: Cursor, batch_size: int, num: int, index: int) -> str:
    cursor = _order.advance(start, index * batch_size, num)
    return f"the batch at epoch {cursor.epoch}, position {cursor.position} ({index} after the first one fed)"


def _check_vocab(source, rows_BT: torch.Tensor, starts: np.ndarray, vocab_size: int) -> None:
    bad = rows_BT >= vocab_size
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise DataError(
            f"{source.name}: token id {int(rows_BT[i, j])} at token {int(starts[i]) + j} is at or beyond the "
            f"vocabulary size {vocab_size}; tokenize with the model's tokenizer or raise vocab_size"
        )


class Loader:
    """Each rank's rows of a deterministic global sequence of ``[B, T + 1]`` token blocks.

    The sequence of global batches is a pure function of ``(seed, epoch, position)``: the same
    on 1, 2 or 64 data-parallel ranks, and resumed exactly from ``state_dict()``. Each batch
    holds ``batch_size`` windows of ``seq_len + 1`` tokens; the input/target shift belongs in
    the loss (``x, y = tokens[:, :-1], tokens[:, 1:]``), so it is traced into the step.

    Args:
      data: a token file path (nanoGPT ``.bin`` or llm.c format), a 1-d integer tensor, or a
        ``fsg.data.TokenFile`` / ``fsg.data.Tokens``.
      batch_size: rows of the *global* batch.
      seq_len: ``T``; each row holds ``T + 1`` tokens.
      seed: chooses the order of windows (a new order each epoch).
      mesh: an ``fsg.Mesh``; on more than one device each rank reads only its rows and gets
        the global batch as a ``DTensor`` (placed by ``batch_sharding``), which ``compile_step``
        takes as it is.
      batch_sharding: the step's batch spec (default ``P("dp")`` when the mesh has ``dp``).
      vocab_size: when given, a token id at or beyond it raises ``DataError``.
      device: where batches go (default: the mesh's device type, else the CPU).
      prefetch: batches held ahead of the consumer, ready or being assembled (0: none).
      workers: background threads assembling different future batches at once (default 1,
        or 0 when ``prefetch=0``; 0: each batch is built in the caller's thread). At most
        ``prefetch``. The batches, their order and the state are the same for any count.
      dtype: the dtype of the token block (default int64).
      format: the token file format: ``"auto"``, ``"llmc"`` or ``"nanogpt"``.
      rank, num_ranks: off a mesh, read data rank ``rank`` of ``num_ranks``'s rows (tests).

    Raises:
      fsg.data.DataError: a bad token file, a ``seq_len`` longer than the data, a batch that
        does not divide over the data ranks (and, when reading, a token id beyond the vocabulary).

    Example:
      >>> loader = fsg.data.Loader(torch.arange(1000), batch_size=4, seq_len=16, prefetch=0)
      >>> next(loader).shape
      torch.Size([4, 17])
    """

    def __init__(self, data: Any, *, batch_size: int, seq_len: int, seed: int = 0, mesh: Mesh | None = None,
                 batch_sharding: P | None = None, vocab_size: int | None = None, device: Any = None,
                 prefetch: int = 2, workers: int | None = None, dtype: torch.dtype = torch.int64, format: str = "auto",
                 rank: int | None = None, num_ranks: int | None = None):  # fmt: skip
        self.batch_size = checks.integer("Loader(batch_size=...)", batch_size, low=1)
        self.seq_len = checks.integer("Loader(seq_len=...)", seq_len, low=1)
        self.seed = checks.integer("Loader(seed=...)", seed, low=0)
        self.prefetch = checks.integer("Loader(prefetch=...)", prefetch, low=0)
        if workers is None:
            workers = 1 if prefetch > 0 else 0
        self.workers = checks.integer("Loader(workers=...)", workers, low=0)
        if workers > prefetch:
            raise checks.fail(
                "Loader(workers=...)", f"must be at most prefetch={prefetch} (a worker builds one of the batches "
                f"held ahead)", workers, f"raise prefetch to {workers}, or use workers=0 to build in the caller",
            )  # fmt: skip
        if vocab_size is not None:
            checks.integer("Loader(vocab_size=...)", vocab_size, low=1)
        self.source = as_source(data, format=format)
        name = self.source.name
        if len(self.source) < seq_len + 1:
            raise DataError(
                f"{name}: seq_len={seq_len} needs windows of {seq_len + 1} tokens but the data holds "
                f"{len(self.source)} tokens; use a shorter seq_len or more data"
            )
        self.num_windows = (len(self.source) - 1) // seq_len
        if batch_size > self.num_windows:
            raise DataError(
                f"{name}: a global batch of {batch_size} rows needs {batch_size} windows of {seq_len + 1} tokens "
                f"but the data holds {self.num_windows} ({len(self.source)} tokens); use a smaller batch_size or seq_len"
            )
        self.mesh = mesh
        self._rank = data_rank(mesh, batch_sharding, batch_size=batch_size, seq_len=seq_len, name=name,
                               rank=rank, num_ranks=num_ranks)  # fmt: skip
        self.device = torch.device(device if device is not None else _default_device(mesh))
        self._produce = functools.partial(
            _produce, self.source, seed=self.seed, batch_size=batch_size, seq_len=seq_len, num=self.num_windows,
            rank=self._rank.rank, num_ranks=self._rank.num_ranks, vocab_size=vocab_size, dtype=dtype,
        )  # fmt: skip
        self._cursor = Cursor(0, 0)
        self._prefetcher: Prefetcher | None = None

    @property
    def rank(self) -> int:
        """This process's index among the data-parallel ranks."""
        return self._rank.rank

    @property
    def num_ranks(self) -> int:
        """The number of data-parallel ranks the global batch is split over."""
        return self._rank.num_ranks

    @property
    def epoch(self) -> int:
        """The epoch of the next batch's first window."""
        return self._cursor.epoch

    @property
    def position(self) -> int:
        """The next batch's first window's index within its epoch."""
        return self._cursor.position

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> torch.Tensor:
        """The next batch: this rank's ``[B / R, T + 1]`` rows, as the global ``[B, T + 1]``
        ``DTensor`` on a mesh of several devices."""
        if self._prefetcher is None:
            at = (self._cursor, self.batch_size, self.num_windows)
            self._prefetcher = Prefetcher(
                functools.partial(_produce_at, self._produce, *at), depth=self.prefetch, workers=self.workers,
                device=self.device, describe=functools.partial(_describe, *at),
            )  # fmt: skip
        try:
            rows_BT, self._cursor = self._prefetcher.next()
        except BaseException:
            self.close()  # the state stays at the failed batch; the next next() tries it again
            raise
        if self._rank.placements is None:
            return rows_BT
        return DTensor.from_local(
            rows_BT, self.mesh.device_mesh, self._rank.placements, run_check=False,
            shape=torch.Size((self.batch_size, self.seq_len + 1)), stride=(self.seq_len + 1, 1),
        )  # fmt: skip

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The loader's position: ``{"seed", "epoch", "position", "num_windows"}``, 0-d int64
        tensors, the same on every rank (on a mesh of several devices, replicated DTensors, as
        the train state's leaves are, so that a checkpoint writes them once). Save it beside the
        train state; ``restore`` it onto a loader over the same data with any number of ranks
        (and any batch size)."""
        values = (self.seed, self._cursor.epoch, self._cursor.position, self.num_windows)
        state = {k: torch.tensor(v, dtype=torch.int64) for k, v in zip(STATE_KEYS, values)}
        if self._rank.placements is None:
            return state
        replicated = [Replicate()] * self.mesh.device_mesh.ndim
        return {k: DTensor.from_local(v, self.mesh.device_mesh, replicated, run_check=False) for k, v in state.items()}

    def restore(self, state: dict[str, Any]) -> Loader:
        """Continues from a ``state_dict()``: the next batch is the one that followed it.

        Raises:
          fsg.data.DataError: the state is malformed, or was saved over another number of
            windows (other data or another ``seq_len``).
        """
        if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise DataError(f"Loader.restore: a loader state has the keys {list(STATE_KEYS)}; got {got}")
        seed, epoch, position, num = (int(_local(state[k])) for k in STATE_KEYS)
        if num != self.num_windows:
            raise DataError(
                f"{self.source.name}: the saved loader state is over {num} windows but this loader has "
                f"{self.num_windows} (seq_len={self.seq_len}, {len(self.source)} tokens): other data or another "
                f"seq_len; restore onto the data and seq_len it was saved with"
            )
        if epoch < 0 or not 0 <= position < num:
            raise DataError(f"Loader.restore: epoch {epoch} / position {position} is not a position in {num} windows")
        self.close()
        self.seed = seed
        self._produce = functools.partial(self._produce, seed=seed)
        self._cursor = Cursor(epoch, position)
        return self

    def close(self) -> None:
        """Stops the background workers and joins them (batches they built ahead are dropped);
        the next batch starts them again where the loader stands."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_prefetcher", None) is not None:
            self.close()

    def __repr__(self) -> str:
        return (
            f"Loader({self.source!r}, batch_size={self.batch_size}, seq_len={self.seq_len}, seed={self.seed}, "
            f"rank={self.rank}/{self.num_ranks}, epoch={self.epoch}, position={self.position})"
        )


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value  # replicated: every rank holds it


def _default_device(mesh: Mesh | None) -> torch.device:
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
