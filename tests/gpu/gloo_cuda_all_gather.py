"""Plain torch, no fsg: ``_c10d_functional.all_gather_into_tensor`` (what DTensor and fsg's
FSDP and TP steps all-gather with) on a gloo group with CUDA tensors. On torch 2.11 (H100,
2026-12-05) it killed the rank with SIGSEGV even at 1,024 elements, while
``dist.all_gather_into_tensor`` and the functional ``reduce_scatter_tensor`` on the same
group worked. ``tests/gpu/test_sharding_cuda.py`` runs this to decide whether its
all-gathering presets can run on gloo over one GPU. Exit 0: the gather worked."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.set_device(0)
    x = torch.full((1024,), float(rank + 1), device="cuda")
    f = torch.ops._c10d_functional
    y = f.wait_tensor.default(f.all_gather_into_tensor.default(x, 2, dist.group.WORLD.group_name))
    assert bool((y[:1024] == 1).all() and (y[1024:] == 2).all()), "wrong gather"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(int(sys.argv[1]),), nprocs=2)
