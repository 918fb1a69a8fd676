"""A training run with dropout that a test starts in fresh processes:

    python -m tests.resume.worker STEPS [--save DIR] [--restore DIR] [--backend B]

prints one line per step, the loss as a float hex string (bit for bit), after restoring the
state from ``--restore`` if given, and saves the final state to ``--save`` if given."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import fsg


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 4)
    )


def batch(i: int) -> dict:
    g = torch.Generator().manual_seed(1000 + i)
    return {"x": torch.randn(32, 8, generator=g), "y": torch.randn(32, 4, generator=g)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("--save")
    parser.add_argument("--restore")
    parser.add_argument("--backend", default="eager")
    args = parser.parse_args()
    net = model()
    step = fsg.compile_step(
        lambda params, b: F.mse_loss(fsg.apply(net, params, b["x"]), b["y"]),
        optimizer=fsg.optim.adamw(1e-2),
        backend=args.backend,
    )
    state = step.init(fsg.params(net), seed=11)
    if args.restore:
        state = fsg.checkpoint.restore(args.restore, like=state)
    start = int(state.step)
    for i in range(start, start + args.steps):
        state, metrics = step(state, batch(i))
        print(float(metrics["loss"]).hex(), flush=True)
    if args.save:
        fsg.checkpoint.save(args.save, state)


if __name__ == "__main__":
    main()
