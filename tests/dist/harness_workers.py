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
