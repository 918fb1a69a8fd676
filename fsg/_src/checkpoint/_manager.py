"""``CheckpointManager``: periodic, asynchronous, pruned checkpoints of a training run."""

from __future__ import annotations

import atexit
import re
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsg._src import checks
from fsg._src.checkpoint import _checkpoint, _io
from fsg._src.errors import CheckpointError

_STEP_DIR = re.compile(r"step_(\d{8})")
_LIVE: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()  # managers whose pending save exit flushes
_FLUSH_REGISTERED = False


def _flush_at_exit() -> None:
    """Finishes every pending background save when the interpreter exits: without it, a script
    that returns right after ``save`` would lose that checkpoint (its writer is a daemon thread).
    Registered at the first manager's creation, so it runs before ``fsg.distributed.shutdown``
    (atexit runs last-registered first) while the savers' process group still exists."""
    for manager in list(_LIVE):
        try:
            manager.wait()
        except CheckpointError as exc:
            print(f"fsg: at exit, {exc}", file=sys.stderr)


class CheckpointManager:
    """Saves a run's state every ``save_interval_steps`` steps into ``directory/step_NNNNNNNN``,
    keeps the newest ``max_to_keep``, and restores the latest.

    With ``async_save=True`` (default) ``save`` blocks only while the state is copied to host
    memory; the files are written by a background thread. ``latest``, ``all_steps``, ``restore``
    and ``restore_or_init`` wait for it first, and interpreter exit finishes it. An error of a
    background save is raised by the next ``save``, ``wait`` or read. The directory must be visible to every
    rank (a shared filesystem).

    Example:
      >>> import tempfile
      >>> m = fsg.checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
      >>> state = {"w": torch.zeros(3)}
      >>> for step in range(3):
      ...     state["w"] += 1
      ...     _ = m.save(step, state)
      >>> m.wait(); m.all_steps()
      [1, 2]
      >>> m.restore(m.latest(), like=state)["w"]
      tensor([3., 3., 3.])
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        global _FLUSH_REGISTERED
        checks.instance("CheckpointManager(directory)", directory, (str, Path), what="a path (str or pathlib.Path)")
        if max_to_keep is not None:
            checks.integer("CheckpointManager(max_to_keep=...)", max_to_keep, low=1,
                           fix="Keep at least the newest checkpoint, or pass None to keep them all")  # fmt: skip
        checks.integer("CheckpointManager(save_interval_steps=...)", save_interval_steps, low=1)
        checks.flag("CheckpointManager(async_save=...)", async_save)
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"CheckpointManager: {self.directory} is a file, not a directory; pick another path")
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        rank, world = _checkpoint._rank_world()
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        # Background saves coordinate on a group of their own, so that their collectives never
        # interleave with the training step's on the default group.
        self._group = dist.new_group(backend="gloo") if world > 1 and async_save else None
        _checkpoint._barrier(self._group)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: list = []  # pinned host buffers of the last snapshot (CUDA state)
        _LIVE.add(self)
        if not _FLUSH_REGISTERED:
            atexit.register(_flush_at_exit)
            _FLUSH_REGISTERED = True

    def step_dir(self, step: int) -> Path:
        """The directory of the checkpoint of ``step``."""
        return self.directory / f"step_{step:08d}"

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first. Waits for a save in flight; a
        checkpoint without its commit marker (its save never finished) is not listed."""
        self.wait()
        return self._committed_steps()

    def _committed_steps(self) -> list[int]:
        steps = []
        for child in self.directory.iterdir() if self.directory.is_dir() else ():
            match = _STEP_DIR.fullmatch(child.name)
            if match and _io.is_committed(child):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> int | None:
        """The newest step with a complete checkpoint, or ``None``. Waits for a save in flight."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, *, metadata: Any = None, force: bool = False) -> bool:
        """Saves ``state`` as the checkpoint of ``step`` if ``step`` is a multiple of
        ``save_interval_steps`` (or ``force``). Returns whether it saved. Call on every rank."""
        checks.integer("CheckpointManager.save(step)", step, low=0, fix="Pass the training step, e.g. int(state.step)")
        self.wait()
        if not force and step % self.save_interval_steps:
            return False
        path = self.step_dir(step)
        paths, leaves, items = _checkpoint.local_items(state)
        if not self.async_save:
            _checkpoint.write(path, paths, leaves, items, metadata)
            self._prune()
            return True
        # The only blocking part: a host snapshot, since training goes on updating the state
        # in place (donation) while the files are written.
        snapshot = self._snapshot(items)
        self._thread = threading.Thread(
            target=self._write,
            args=(path, paths, leaves, snapshot, metadata),
            name=f"fsg-checkpoint-{step}",
            daemon=True,
        )
        self._thread.start()
        return True

    def _snapshot(self, items: list) -> list:
        """Host copies of the pieces. Device tensors go to pinned buffers kept across saves
        (same shapes every time), copied asynchronously with one synchronize at the end."""
        tensors = [t.detach() for _, _, t in items]
        if not any(t.device.type == "cuda" for t in tensors):
            return [(i, box, t.clone()) for (i, box, _), t in zip(items, tensors)]
        shapes = [(t.shape, t.dtype) for t in tensors]
        if [(b.shape, b.dtype) for b in self._buffers] != shapes:
            self._buffers = [torch.empty(s, dtype=d, pin_memory=True) for s, d in shapes]
        for buffer, t in zip(self._buffers, tensors):
            buffer.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        return [(i, box, b) for (i, box, _), b in zip(items, self._buffers)]

    def _write(self, path, paths, leaves, items, metadata) -> None:
        try:
            _checkpoint.write(path, paths, leaves, items, metadata, group=self._group)
            self._prune()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the next save() or wait()
            self._error = exc

    def _prune(self) -> None:
        if _checkpoint._rank_world(self._group)[0] != 0:
            return
        for stale in self.directory.glob("step_*.tmp"):
            _io.remove(stale)  # left by a crash; saves run one at a time, so none is live
        if self.max_to_keep is not None:
            for step in self._committed_steps()[: -self.max_to_keep]:
                _io.remove(self.step_dir(step))

    def wait(self) -> None:
        """Waits for the background save, if any; raises its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"a background checkpoint save failed: {error}") from error

    def restore(self, step: int, like: Any, *, select: str = _checkpoint.ROOT) -> Any:
        """Restores the checkpoint of ``step`` into the layout of ``like`` (see ``restore``).
        Waits for a save in flight first; a checkpoint without its commit marker is refused."""
        self.wait()
        if step is None:
            raise CheckpointError(
                f"CheckpointManager.restore(None): {self.directory} has no complete checkpoint (latest() is None); "
                f"use restore_or_init(init_fn) to start fresh when there is none"
            )
        checks.integer(
            "CheckpointManager.restore(step)", step, low=0, fix=f"Pick one of all_steps() = {self.all_steps()}"
        )
        return _checkpoint.restore(self.step_dir(step), like, select=select)

    def restore_or_init(self, init_fn: Callable[[], Any]) -> Any:
        """The latest checkpoint restored into ``init_fn()``'s layout, or ``init_fn()`` itself
        when there is none: the first line of a resumable script.

        Example:
          >>> state = manager.restore_or_init(lambda: step.init(fsg.params(model)))  # doctest: +SKIP
        """
        checks.function("CheckpointManager.restore_or_init(init_fn)", init_fn,
                        fix="Pass a function that builds the fresh state: lambda: step.init(fsg.params(model))")  # fmt: skip
        state = init_fn()
        latest = self.latest()  # waits for a save in flight
        return state if latest is None else self.restore(latest, like=state)

    def close(self) -> None:
        """Waits for the last save."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
