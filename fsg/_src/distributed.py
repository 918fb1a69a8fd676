"""Process-group set-up from the ``torchrun`` environment."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from fsg._src import _torch_private
from fsg._src.errors import ArgumentError, MeshError

_log = logging.getLogger("fsg.distributed")
_BEFORE_SHUTDOWN: list[Callable[[], Any]] = []  # see before_shutdown
_SHUTDOWNS = [0]  # how many times this process has shut down: keys each exit barrier apart
EXIT_BARRIER_TIMEOUT_S = 30.0
COLLECTIVE_THREADS_DRAIN_S = 0.1  # see release_collective_threads


class ProcessInfo(NamedTuple):
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def initialize(*, backend: str | None = None) -> ProcessInfo:
    """Initializes ``torch.distributed`` from the environment ``torchrun`` sets.

    Picks the device (``cuda:LOCAL_RANK`` when CUDA is available, else CPU) and the backend
    (NCCL on CUDA, gloo on CPU; ``backend="gloo"`` forces CPU), and registers a clean shutdown at exit. Without ``torchrun``
    (no ``WORLD_SIZE`` in the environment) it is a single process and nothing is initialized.
    Calling it again returns the same information.

    Returns:
      ``ProcessInfo(rank, world_size, local_rank, device)``.

    Example:
      >>> info = fsg.distributed.initialize()   # under torchrun --nproc-per-node=2: rank 0 or 1
    """
    known = dist.Backend.backend_list
    if backend is not None and not (isinstance(backend, str) and all(b.split(":")[-1] in known for b in backend.split(","))):
        raise ArgumentError(
            f"fsg.distributed.initialize(backend={backend!r}): not a torch.distributed backend; pass None "
            f"(NCCL on CUDA, gloo on CPU), 'gloo' or 'nccl'"
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise MeshError(
            f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; launch at most "
            f"that many processes per node (torchrun --nproc-per-node), or pass backend='gloo' to run on CPU"
        )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), device_id=device if use_cuda else None)
        atexit.register(shutdown)
    return ProcessInfo(rank, world_size, local_rank, device)


def shutdown() -> None:
    """Destroys the default process group, if any (registered at exit by ``initialize``).

    On a clean exit every rank first waits (at most ``EXIT_BARRIER_TIMEOUT_S``, through the
    process group's key-value store) until all ranks have reached ``shutdown``, so no rank
    tears down its groups while a peer is still using them. After destroying the group it
    gives up the GIL for a moment (``release_collective_threads``), so no backend thread frees
    a finished collective while the interpreter finalizes (which aborts the process).

    Steps replayed as CUDA graphs (``cuda_graph=True`` on a mesh) drop their graphs first:
    NCCL's teardown can hang while graphs that captured its kernels are alive
    (pytorch/pytorch#115388). Such a step captures again if called after a new ``initialize``.
    """
    if dist.is_available() and dist.is_initialized():
        for release in _BEFORE_SHUTDOWN:
            release()
        if getattr(sys, "last_value", None) is None:  # a clean exit, not an uncaught exception
            _exit_barrier(EXIT_BARRIER_TIMEOUT_S)
        dist.destroy_process_group()
        release_collective_threads()


def release_collective_threads(seconds: float = COLLECTIVE_THREADS_DRAIN_S) -> None:
    """Gives up the GIL for ``seconds`` so the backends' threads can drop finished collectives
    before Python finalizes.

    A gloo worker thread (and, we expect, NCCL's watchdog) drops its own reference to a
    collective after the caller's wait has returned; freeing the collective's tensors takes
    the GIL. If the main thread is finalizing the interpreter by then, CPython ends the
    waiting thread with ``pthread_exit``, whose forced unwind through a ``noexcept`` destructor
    aborts the process:
    "terminate called without an active exception", SIGABRT after a run whose every step
    succeeded (seen in CI with two ``torchrun`` nodes; under gdb, ``~AsyncAllreduceWork`` in
    ``ProcessGroupGloo::runLoop`` -> ``take_gil`` -> ``PyThread_exit_thread``).
    ``destroy_process_group`` does not join those threads while anything still references a
    group (DTensor's redistribute-plan cache, ``torch.distributed.nn.functional``'s defaults, a
    script's global mesh), so the threads outlive it; once they hold no finished work, they
    touch no Python object again and finalization is safe.
    """
    time.sleep(seconds)


def _exit_barrier(timeout_s: float) -> bool:
    """Waits until every rank has reached ``shutdown`` (through the process group's store, so it
    never pairs with a peer's collective), at most ``timeout_s``; returns whether all arrived.

    It keeps a rank that finishes first from destroying its groups while a peer may still
    complete collectives with it. (An abort at exit that this barrier was first meant to fix,
    "terminate called without an active exception", turned out to be a backend thread freeing
    a finished collective during finalization: ``release_collective_threads`` fixes that.)
    A rank that exits on an uncaught exception skips it: its peers are inside a collective.
    """
    try:
        store = _torch_private.default_store()
        world = dist.get_world_size()
        key = f"fsg/shutdown/{_SHUTDOWNS[0]}"
        _SHUTDOWNS[0] += 1
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world:
            if time.monotonic() > deadline:
                _log.warning(
                    "fsg.distributed.shutdown: not every rank reached shutdown within %.0f s; "
                    "destroying the process group anyway",
                    timeout_s,
                )
                return False
            time.sleep(0.005)
        return True
    except Exception as e:  # the store went away with a peer that already exited: nothing to wait for
        _log.debug("fsg.distributed.shutdown: exit barrier skipped (%s)", e)
        return False


def before_shutdown(release: Callable[[], Any]) -> None:
    """Registers ``release`` to run in ``shutdown`` before the process group is destroyed
    (the CUDA-graph replayer drops its graphs there)."""
    if release not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(release)
