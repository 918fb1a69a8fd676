"""What ``test_exit_after_collectives.py`` launches on every rank, plain torch (no fsg import, whose
own exit work would hide the hazard): collectives on the world and on a subgroup, both groups
kept alive until the interpreter finalizes (as a script's global mesh would, and as
``torch.distributed.nn.functional``'s default arguments keep the world group), the process group
destroyed right after the last collective, then the GIL given up for ``argv[1]`` seconds, as
``fsg.distributed.shutdown`` does (``release_collective_threads``), and the end of the script."""

import sys
import time

import torch
import torch.distributed as dist


def main(pause_s: float) -> tuple:
    dist.init_process_group("gloo")
    groups = (dist.group.WORLD, dist.new_group([0, 1]))
    x = torch.ones(1)
    for _ in range(20):
        dist.all_reduce(x)
        dist.all_reduce(x, group=groups[1])
    dist.destroy_process_group()
    if pause_s > 0:  # even sleep(0) gives up the GIL for a moment
        time.sleep(pause_s)
    return groups


if __name__ == "__main__":
    held = main(float(sys.argv[1]))
