"""A pool of ranks that keeps one gloo process group alive across many test cases.

Starting processes and a process group costs seconds; a property test runs dozens of cases.
``MultiRank(world_size)`` starts the ranks once; ``run(fn, *args)`` runs ``fn(*args)`` on
every rank at once and returns the per-rank results (or raises the first rank's error, with
its traceback). ``fn`` must be importable by name (a module-level function).
``MultiRank(n, device="cuda")`` puts every rank on GPU 0, still joined over gloo (which moves
CUDA tensors through the host): one GPU checks the CUDA code of a mesh step (Inductor's GPU
kernels, fsg's Triton kernels), which CPU ranks never run.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

from fsg._src import checks

_MESHES: dict[tuple, Any] = {}


def _worker(rank: int, world_size: int, init_file: str, tasks, results, device: str = "cpu") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # a crash in native code (SIGSEGV, SIGABRT, SIGBUS) sends no result: its Python stack goes
    # to a file the parent reads into the RankError
    faulthandler.enable(open(_crash_log(init_file, rank), "w"), all_threads=True)  # noqa: SIM115 - open until exit
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)  # before any mesh: DeviceMesh keeps a device already set

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    from fsg._src.distributed import release_collective_threads

    release_collective_threads()  # before this process finalizes: see its docstring


def _crash_log(init_file: str, rank: int) -> str:
    return f"{init_file}.rank{rank}.crash"


def _death(exitcode: int | None, crash_log: str) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = " (the out-of-memory killer sends it, among others)" if name == "SIGKILL" else ""
        message = f"ProcessDied: the rank's process was killed by {name}{why}"
    else:
        message = f"ProcessDied: the rank's process exited with code {exitcode}"
    try:
        with open(crash_log) as f:
            stack = f.read().strip()
    except OSError:
        stack = ""
    return message + (f"\nits stacks when it died (faulthandler):\n{stack[-6000:]}" if stack else "")


def _report(world_size: int, out: dict, errors: dict[int, str], silent_why: str) -> str:
    """The first failure in full (a dead process first, one killed by a signal before one that
    exited: the others' errors, and a peer's exit when its collective broke, are often its
    echo), then one line for each other rank."""
    silent = {r: f"TimeoutError: {silent_why}" for r in range(world_size) if r not in out and r not in errors}
    failed = {**errors, **silent}

    def cause_first(r: int) -> tuple:
        died = failed[r].startswith("ProcessDied")
        return not died, not (died and "killed by" in failed[r].splitlines()[0]), r in silent, r

    first = min(failed, key=cause_first)
    lines = [f"rank {first} of {world_size} failed:\n{failed[first]}"]
    for r in sorted(set(range(world_size)) - {first}):
        state = "finished" if r in out else (failed[r].strip().splitlines() or ["?"])[-1]
        lines.append(f"  rank {r}: {state}")
    return "\n".join(lines[:1] + (["the other ranks:"] + lines[1:] if world_size > 1 else []))


class RankError(AssertionError):
    """A function failed on one of the ranks; the message holds that rank's traceback."""


class MultiRank:
    """``world_size`` processes joined in one gloo process group, on CPU or (``device="cuda"``)
    all on GPU 0.

    Example:
      >>> with fsg.testing.MultiRank(2) as ranks:          # doctest: +SKIP
      ...     ranks.run(my_module.check_sharded_step)       # runs on both ranks
    """

    def __init__(self, world_size: int, *, timeout: float = 300.0, device: str = "cpu"):
        checks.integer("MultiRank(world_size)", world_size, low=1, fix="It is the number of ranks to start, e.g. 2")
        checks.real("MultiRank(timeout=...)", timeout, low=0.0, low_open=True, fix="Seconds a run may take")
        if device not in ("cpu", "cuda"):
            raise checks.fail("MultiRank(device=...)", "is 'cpu' or 'cuda'", device, "'cuda' puts every rank on GPU 0")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise checks.fail(
                    "MultiRank(device=...)", "is 'cuda' only where torch sees a GPU", device,
                    "Use device='cpu' here, or skip the test without CUDA",
                )  # fmt: skip
        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="fsg-gloo-")
        os.close(fd)
        os.unlink(self._init_file)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, self._init_file, self._tasks[r], self._results, device),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results by rank.

        If a rank fails, the others may be stuck in a collective that will never complete:
        the pool waits a few seconds for them, then is shut down (``closed``) and a ``RankError``
        is raised holding every rank's outcome: a rank's traceback, or how a rank's process died
        (a signal such as SIGKILL from the out-of-memory killer, a crash in native code) — a
        peer's "Connection reset by peer" is usually that death's echo. Start a new pool to go on.
        """
        if self._closed:
            raise RuntimeError("this MultiRank pool was shut down after a failure; start a new one")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline, grace = time.monotonic() + self.timeout, False
        while len(out) + len(errors) < self.world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                for rank, p in enumerate(self._procs):  # a dead rank sends nothing: say how it died
                    if rank not in out and rank not in errors and not p.is_alive():
                        errors[rank] = _death(p.exitcode, _crash_log(self._init_file, rank))
            else:
                (out.__setitem__(rank, value) if ok else errors.__setitem__(rank, value))
            if errors and not grace:  # the rest may be stuck in a collective: seconds, not the timeout
                grace, deadline = True, min(deadline, time.monotonic() + 5.0)
        if errors or len(out) < self.world_size:
            self.close(wait=False)
            silent = "still running 5 s after the first failure (likely waiting in a collective for it)"
            raise RankError(_report(self.world_size, out, errors, silent if grace else f"no result within {self.timeout:.0f}s"))
        return [out[r] for r in range(self.world_size)]

    def close(self, *, wait: bool = True) -> None:
        """Stops the ranks (at once, with ``wait=False``)."""
        if self._closed:
            return
        self._closed = True
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10 if wait else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for path in [self._init_file] + [_crash_log(self._init_file, r) for r in range(self.world_size)]:
            if os.path.exists(path):
                os.unlink(path)

    def __enter__(self) -> MultiRank:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mesh(axes: dict[str, int], device_type: str = "cpu"):
    """An ``fsg.Mesh`` for ``axes`` on ``device_type`` (``"cuda"`` in a ``MultiRank(device=
    "cuda")`` pool), made once per process (device meshes create process groups; a property
    test asks for the same few meshes many times)."""
    from fsg._src.mesh import Mesh

    checks.instance("fsg.testing.mesh(axes)", axes, dict, what="a dict {name: size}", fix="E.g. {'dp': 2}")
    key = (tuple(axes.items()), device_type)
    if key not in _MESHES:
        _MESHES[key] = Mesh(dict(axes), device_type=device_type)
    return _MESHES[key]
