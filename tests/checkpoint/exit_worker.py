"""Saves one checkpoint asynchronously and returns at once: the interpreter's exit must finish
the save (tests/checkpoint/test_manager_edges.py). The write is slowed down so that it is still
in flight when the script ends.

Usage: python -m tests.checkpoint.exit_worker DIRECTORY
"""

import sys
import time

import torch

import fsg
from fsg._src.checkpoint import _manager


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 256, generator=g), "step": torch.tensor(7)}


def main() -> None:
    write = _manager._checkpoint.write

    def slow_write(*args, **kwargs):
        time.sleep(1.0)
        write(*args, **kwargs)

    _manager._checkpoint.write = slow_write
    manager = fsg.checkpoint.CheckpointManager(sys.argv[1])
    manager.save(7, state())
    print("saved", flush=True)  # and return: no wait(), no close()


if __name__ == "__main__":
    main()
