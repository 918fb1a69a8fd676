"""Running one rank's schedule: each action's compiled graph, the messages between them, the
gradients summed over microbatches, and the wall-clock time of every action."""

from __future__ import annotations

import time
from typing import Any

import torch

from fsg._src import tree
from fsg._src.pipeline import data_axes
from fsg._src.pipeline.actions import Action
from fsg._src.pipeline.exchange import Exchange
from fsg._src.pipeline.plan import Plan
from fsg._src.pipeline.simulate import Event
from fsg._src.sharding import spmd
from fsg._src.trace import random, tracing


class Result:
    """What one rank's run of the schedule leaves: gradients of the parameters it holds
    (summed over its stages and microbatches, each weighted ``1 / num_microbatches``), the
    microbatches' losses and aux (on the last stage's rank) and its timeline."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.outputs: list[tuple[torch.Tensor, ...]] = []
        self.events: list[Event] = []


def run(
    plan: Plan, me: int, ranks: list[int], params: dict[str, torch.Tensor], batch: Any, rng: torch.Tensor
) -> Result:
    """Runs pipeline index ``me``'s actions of ``plan.schedule`` on ``params`` (its own), the
    global ``batch`` and the step's key ``rng``."""
    schedule, stages = plan.schedule, plan.stages
    m, last = schedule.num_microbatches, schedule.num_stages - 1
    micro = [tree.flatten(mb)[0] for mb in tracing.microbatches(batch, m)]
    if plan.data is not None:  # this rank's rows of each microbatch
        micro = [[spmd.local_shard(t, p, plan.data) for t, p in zip(mb, plan.batch_placements)] for mb in micro]
    for j, mb in enumerate(micro):  # each microbatch's keys: it draws what the unrolled step draws for it
        offset = random.call_offset(j, plan.random_calls)
        mb += [rng, torch.tensor(offset, dtype=torch.int64, device=rng.device)]
    width = 1 + max(len(s.outputs) for s in stages)
    exchange = Exchange(me, ranks, schedule.num_stages, m, width)
    device = next(iter(params.values())).device
    inputs: dict[tuple[int, int], tuple[list, list, list]] = {}  # (stage, mb) -> params, batch, activations
    cotangents: dict[tuple[int, int], list] = {}
    held: dict[tuple[int, int], list] = {}  # full backward: input gradients sent after W
    sums: dict[tuple[int, int], torch.Tensor] = {}  # (stage, param index) -> its gradient summed over microbatches
    result = Result()
    weight = torch.full((), 1.0 / m, dtype=stages[last].outputs[0].dtype, device=device)

    def send_gradients(s: int, j: int, grads: list) -> None:
        if s > 0:
            exchange.send(schedule.rank_of(s - 1), ("B", s - 1, j), grads)

    for action in schedule.actions[me]:
        kind, s, j = action
        stage, fns = stages[s], plan.fns[s]
        if kind == "F":
            acts = exchange.receive(schedule.rank_of(s - 1), ("F", s, j), fns.input_like, device) if s > 0 else []
            own = [params[plan.names[i]] for i in stage.params]
            inputs[(s, j)] = (own, [micro[j][b] for b in stage.batch], acts)
            start = time.time()
            out = fns.forward(*own, *inputs[(s, j)][1], *acts)
            end = time.time()
            if s == last:
                result.outputs.append(tuple(out))
            else:
                exchange.send(schedule.rank_of(s + 1), ("F", s + 1, j), out)
        elif kind == "B":
            if s == last:
                cot = [weight]
            else:
                wanted = [t for t, d in zip(fns.output_like, fns.grad_outputs) if d]
                cot = exchange.receive(schedule.rank_of(s + 1), ("B", s, j), wanted, device)
            cotangents[(s, j)] = cot
            start = time.time()
            grads = list(fns.backward_input(*_flat(inputs[(s, j)]), *cot)) if fns.backward_input else []
            end = time.time()
            if schedule.full_backward:
                held[(s, j)] = grads
            else:
                send_gradients(s, j, grads)
        else:
            start = time.time()
            grads = fns.backward_weight(*_flat(inputs.pop((s, j))), *cotangents.pop((s, j)))
            for i, g in zip([i for i in stage.params if params[plan.names[i]].is_floating_point()], grads):
                sums[(s, i)] = g if (s, i) not in sums else sums[(s, i)] + g
            end = time.time()
            if schedule.full_backward:
                send_gradients(s, j, held.pop((s, j)))
        result.events.append(Event(Action(kind, s, j), start, end))
    exchange.finish()
    for (s, i), g in sums.items():  # each stage's sum over dp where it is a partial sum, then over stages
        if plan.data is not None:
            g = data_axes.reduce_gradient(g, plan.fns[s].weight_placements[i], plan.data)
        name = plan.names[i]
        result.grads[name] = g if name not in result.grads else result.grads[name] + g
    return result


def _flat(inputs: tuple[list, list, list]) -> list:
    own, batch, acts = inputs
    return [*own, *batch, *acts]
