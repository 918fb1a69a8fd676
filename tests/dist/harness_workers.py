"""Functions for tests/dist/test_harness.py (importable by name in the workers)."""

import torch
import torch.distributed as dist


def rank_and_sum():
    t = torch.ones(1) / dist.get_world_size()
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that never comes
    return float(t)


def exit_barrier_waits_for_the_late_rank():
    import time

    from fsg._src import distributed

    if dist.get_rank() == 1:
        time.sleep(1.0)
    t0 = time.perf_counter()
    arrived = distributed._exit_barrier(timeout_s=60.0)
    return arrived, time.perf_counter() - t0


def exit_barrier_times_out_without_the_peer():
    import time

    from fsg._src import distributed

    if dist.get_rank() == 1:  # never arrives; keeps its barrier count in step with rank 0's
        distributed._SHUTDOWNS[0] += 1
        return None
    t0 = time.perf_counter()
    arrived = distributed._exit_barrier(timeout_s=0.5)
    return arrived, time.perf_counter() - t0


def killed_on_rank_1():
    """Rank 1's process is killed (as the out-of-memory killer would) while rank 0 waits in a
    collective for it."""
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def crashes_in_native_code_on_rank_1():
    """Rank 1 dies of a segmentation fault (a crash in native code) while rank 0 waits."""
    import ctypes

    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def killed_once_on_rank_1(flag: str):
    """The first call kills rank 1's process (and leaves ``flag``); later calls all-reduce."""
    import os
    import signal

    if dist.get_rank() == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)
