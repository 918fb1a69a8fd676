"""Saves checkpoints in a loop until killed; every leaf of step s holds values derived from s."""

import sys

import torch

import fsg


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "params": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)},
        "step": torch.tensor(step),
        "half": torch.randn(1000, generator=g).bfloat16(),
    }


if __name__ == "__main__":
    manager = fsg.checkpoint.CheckpointManager(sys.argv[1], max_to_keep=2, async_save=sys.argv[2] == "async")
    start = (manager.latest() or 0) + 1
    print("ready", flush=True)
    for step in range(start, start + 10_000):
        manager.save(step, state_for(step))
