"""Feeding: background workers that assemble the next batches and copies them to the device.

Batches are numbered ``0, 1, 2, ...`` from where feeding starts, and ``produce(index, pin) ->
(host_block, cursor_after)`` builds any one of them on its own (the batch order is a pure
function of the cursor, ``_order.py``), so ``workers`` threads can build different future
batches at once. A worker claims the lowest unclaimed index while fewer than ``depth`` batches
are claimed but not yet taken, builds it, and files it under its index; the consumer takes
index ``0, 1, 2, ...`` in turn, waiting for the one it needs. The delivered sequence is
therefore the sequence ``produce`` defines, whatever the number of workers, the depth or the
timing, and at most ``depth`` blocks are held ahead (ready or being built).

On CUDA the host block is assembled in pinned memory and each worker copies it on its own side
stream with ``non_blocking=True``; the consumer's stream waits on that copy's event (a wait on
the device, not on the host) and ``record_stream`` keeps the block's memory alive for the
stream that uses it. On the CPU the same path runs without pinning or streams. With no
workers each batch is produced in the caller's thread.

Threads, not processes: the gather (a row gather out of a memory-mapped file, the cast, the
vocabulary check) runs in numpy/torch kernels that release the GIL. What holds it is the
index arithmetic of the permutation, a few hundred microseconds a batch, which bounds the
rate of any number of threads (benchmarks/data.py, docs/data.md).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch

_POLL_S = 0.1


class _Failure(tuple):
    """``(error,)``: an exception of a worker, raised in the consumer at its batch."""


def _note(error: BaseException, note: str) -> None:
    # The error keeps its type and message (what the caller's thread would have raised); the
    # note, printed under its traceback, says where it came from. Notes are Python >= 3.11.
    if sys.version_info >= (3, 11):
        error.add_note(note)


class Prefetcher:
    """Produces batches ``0, 1, 2, ...`` with ``workers`` threads, ``depth`` ahead, on ``device``.

    Args:
      produce: ``produce(index, pin) -> (host_block, cursor_after)`` for batch ``index``
        counted from the start; ``pin`` asks for the block in pinned memory. Called from
        several threads at once when ``workers > 1``.
      depth: how many batches may be claimed ahead of the consumer (ready or being built).
      workers: threads building batches (0: none, each batch is built in ``next()``).
      device: where the batches go.
      describe: ``describe(index)`` names batch ``index`` in the note added to a worker's error.
    """

    def __init__(self, produce: Callable[[int, bool], tuple[torch.Tensor, Any]], *, depth: int, workers: int,
                 device: torch.device, describe: Callable[[int], str] = "batch {}".format):  # fmt: skip
        if workers > depth:
            raise ValueError(
                f"Prefetcher: {workers} workers but depth {depth}: at most depth batches are built at once"
            )
        self._produce = produce
        self._describe = describe
        self._cuda = device.type == "cuda"
        if self._cuda and device.index is None:  # "cuda" is the consumer's device, not the workers'
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._depth = depth
        self._cond = threading.Condition()
        self._claimed = 0  # the next index a worker will build
        self._taken = 0  # the next index the consumer takes
        self._ready: dict[int, Any] = {}  # index -> (block, event, cursor_after) or _Failure
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, args=(k,), name=f"fsg-data-worker-{k}", daemon=True)
            for k in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _to_device(self, host: torch.Tensor, stream) -> tuple[torch.Tensor, Any]:
        if not self._cuda:
            return host.to(self._device), None
        with torch.cuda.stream(stream):
            block = host.to(self._device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return block, event

    def _claim(self) -> int | None:
        with self._cond:
            while not self._stop and self._claimed >= self._taken + self._depth:
                self._cond.wait()
            if self._stop:
                return None
            self._claimed += 1
            return self._claimed - 1

    def _run(self, worker: int) -> None:
        stream = None
        if self._cuda:  # a new thread starts on device 0: pinning there would open a context on it
            torch.cuda.set_device(self._device)
            stream = torch.cuda.Stream(self._device)
        while (index := self._claim()) is not None:
            try:
                host, cursor_after = self._produce(index, self._cuda)
                item = (*self._to_device(host, stream), cursor_after)
            except BaseException as error:  # filed under its index, raised in the consumer there
                _note(error, f"fsg.data: raised in background worker {worker} of {len(self._threads)} "
                             f"while assembling {self._describe(index)}")  # fmt: skip
                item = _Failure((error,))
            with self._cond:
                if not self._stop:
                    self._ready[index] = item
                self._cond.notify_all()
            if isinstance(item, _Failure):
                return  # the consumer closes the rest when it reaches this batch

    def next(self) -> tuple[torch.Tensor, Any]:
        """The next batch on the device (ready for the current stream) and the cursor after it."""
        if not self._threads:
            host, cursor_after = self._produce(self._taken, False)
            self._taken += 1
            return host.to(self._device), cursor_after
        with self._cond:
            while self._taken not in self._ready:
                if self._stop:
                    raise RuntimeError("fsg.data: next() on a closed prefetcher")
                if not any(t.is_alive() for t in self._threads):
                    raise RuntimeError("fsg.data: every background worker stopped")
                self._cond.wait(timeout=_POLL_S)
            item = self._ready.pop(self._taken)
            self._taken += 1
            self._cond.notify_all()  # room for a worker to claim one more
        if isinstance(item, _Failure):
            self.close()
            raise item[0]
        block, event, cursor_after = item
        if event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            block.record_stream(current)
        return block, cursor_after

    def close(self) -> None:
        """Stops the workers and joins them (batches they prepared are dropped). A worker in the
        middle of a batch finishes that one batch first: close() waits at most one batch's time."""
        with self._cond:
            self._stop = True
            self._ready.clear()
            self._cond.notify_all()
        if threading.current_thread() in self._threads:
            # a loader collected by the garbage collector inside a worker, which may hold the
            # lock the others need to leave: joining them there would deadlock; they leave anyway
            return
        for thread in self._threads:
            thread.join()
