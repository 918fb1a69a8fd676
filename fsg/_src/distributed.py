"""Process-group set-up from the ``torchrun`` environment."""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from fsg._src.errors import ArgumentError, MeshError

_BEFORE_SHUTDOWN: list[Callable[[], Any]] = []  # see before_shutdown


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

    Steps replayed as CUDA graphs (``cuda_graph=True`` on a mesh) drop their graphs first:
    NCCL's teardown can hang while graphs that captured its kernels are alive
    (pytorch/pytorch#115388). Such a step captures again if called after a new ``initialize``.
    """
    if dist.is_available() and dist.is_initialized():
        for release in _BEFORE_SHUTDOWN:
            release()
        dist.destroy_process_group()


def before_shutdown(release: Callable[[], Any]) -> None:
    """Registers ``release`` to run in ``shutdown`` before the process group is destroyed
    (the CUDA-graph replayer drops its graphs there)."""
    if release not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(release)
