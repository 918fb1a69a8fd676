"""Pipeline bubble, measured against predicted: every schedule on gloo ranks (CPU).

    python benchmarks/pipeline_bubble.py                      # 4 ranks, 8 microbatches
    python benchmarks/pipeline_bubble.py --ranks 2 --microbatches 4 --width 128

An MLP of ``--layers`` residual tanh layers (``--width`` wide) is split into ``ranks x virtual``
stages balanced by cost and trained with ``fsg.compile_step(pipeline=fsg.Pipeline(schedule))``.
Each rank records the wall-clock start and end of every action (``PipelineStep.events``, the
compute only: a receive's wait is idle time). The measured bubble is ``1 - busy / (ranks x
makespan)`` over the last of ``--steps`` steps; the predicted one is the simulator's
(``fsg.pipeline.simulate``) given the same per-action durations, so the two differ only by what
the model leaves out (message latency, the Python between actions, ranks sharing cores).
Ranks share the host's cores: with fewer cores than ranks the timings are those of a loaded
machine, and the comparison with the model is the point, not the absolute times.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import fsg
import fsg.testing
from fsg.pipeline import Timeline, simulate


class Mlp(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def measure(schedule: str, virtual: int, microbatches: int, layers: int, width: int, rows: int, steps: int):
    """On every rank: (measured bubble, predicted bubble, step seconds) of the last step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Mlp(layers, width)

    def loss_fn(params, batch):
        return ((fsg.apply(net, params, batch["x"]) - batch["y"]) ** 2).mean()

    batch = {"x": torch.randn(rows * microbatches, width), "y": torch.randn(rows * microbatches, 1)}
    mesh = fsg.testing.mesh({"pp": dist.get_world_size()})
    pipeline = fsg.Pipeline(schedule=schedule, virtual_stages=virtual)
    step = fsg.compile_step(
        loss_fn, mesh, optimizer=fsg.optim.sgd(1e-3), accum_steps=microbatches, backend="aot_eager", pipeline=pipeline
    )
    state = step.init(fsg.params(net), batch=batch)
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        state, _ = step(state, batch)
        seconds = time.perf_counter() - t0
    events = [None] * dist.get_world_size()
    dist.all_gather_object(events, step.events)
    measured = Timeline(step.schedule().schedule, tuple(tuple(e) for e in events))
    durations = {e.action: e.end - e.start for rank in events for e in rank}
    return measured.bubble, simulate(measured.schedule, durations).bubble, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=128, help="rows per microbatch")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {args.ranks} gloo ranks on CPU, {args.microbatches} microbatches, "
        f"MLP {args.layers} x {args.width}, {args.rows} rows a microbatch"
    )
    print(f"{'schedule':<14} {'measured':>9} {'predicted':>10} {'step s':>8}")
    with fsg.testing.MultiRank(args.ranks, timeout=1200.0) as ranks:
        for schedule, virtual in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1)]:
            runs = ranks.run(
                measure, schedule, virtual, args.microbatches, args.layers, args.width, args.rows, args.steps
            )
            measured, predicted, seconds = runs[0]
            name = schedule + (f" v={virtual}" if virtual > 1 else "")
            print(f"{name:<14} {measured:>9.3f} {predicted:>10.3f} {max(r[2] for r in runs):>8.3f}")


if __name__ == "__main__":
    main()
