"""Feeding: a background thread that assembles the next batches and copies them to the device.

The thread runs ``produce(cursor) -> (host_block, next_cursor)`` ahead of the consumer, up to
``depth`` batches. On CUDA the host block is assembled in pinned memory and copied on a side
stream with ``non_blocking=True``; the consumer's stream waits on that copy's event (a wait on
the device, not on the host) and ``record_stream`` keeps the block's memory alive for the
stream that uses it. On the CPU the same path runs without pinning or streams. ``depth=0``
produces each batch in the caller's thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable

import torch

_POLL_S = 0.1


class _Failure(tuple):
    """``(error,)``: an exception of the thread, raised in the consumer."""


class Prefetcher:
    """Produces batches from ``start`` on, ``depth`` ahead, on ``device``.

    Args:
      produce: ``produce(cursor, pin) -> (host_block, next_cursor)``; ``pin`` asks for the
        block in pinned memory.
      start: the first cursor.
      depth: how many batches to hold ready (0: no thread).
      device: where the batches go.
    """

    def __init__(
        self, produce: Callable[[Any, bool], tuple[torch.Tensor, Any]], start: Any, *, depth: int, device: torch.device
    ):
        self._produce = produce
        self._cursor = start
        self._device = device
        self._cuda = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="fsg-data-prefetch", daemon=True)
            self._thread.start()

    def _to_device(self, host: torch.Tensor, stream) -> tuple[torch.Tensor, Any]:
        if not self._cuda:
            return host.to(self._device), None
        with torch.cuda.stream(stream):
            block = host.to(self._device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return block, event

    def _run(self) -> None:
        stream = torch.cuda.Stream(self._device) if self._cuda else None
        cursor = self._cursor
        try:
            while not self._stop.is_set():
                host, cursor_after = self._produce(cursor, self._cuda)
                self._put((*self._to_device(host, stream), cursor_after))
                cursor = cursor_after
        except BaseException as error:  # handed to the consumer, raised there
            self._put(_Failure((error,)))

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def next(self) -> tuple[torch.Tensor, Any]:
        """The next batch on the device (ready for the current stream) and the cursor after it."""
        if self._thread is None:
            host, self._cursor = self._produce(self._cursor, False)
            return host.to(self._device), self._cursor
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("fsg.data: the prefetch thread stopped") from None
        if isinstance(item, _Failure):
            self.close()
            raise item[0]
        block, event, self._cursor = item
        if event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            block.record_stream(current)
        return block, self._cursor

    def close(self) -> None:
        """Stops the thread (batches it prepared are dropped)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            while self._thread.is_alive():
                with contextlib.suppress(queue.Empty):  # unblock a put waiting for room
                    self._queue.get_nowait()
                self._thread.join(timeout=_POLL_S)
