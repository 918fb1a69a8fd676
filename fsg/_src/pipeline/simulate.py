"""Running a schedule on paper: each rank's timeline, its bubble, and deadlock detection.

``simulate`` plays every rank's action list in order: an action starts when its rank is free
and every action it depends on has finished (plus the point-to-point latency where the two sit
on different ranks). A rank whose next action waits on one that can never run is a deadlock,
reported by name. The bubble is the idle share of the ranks' time until the last action ends:
``1 - sum(busy) / (pp * makespan)``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, NamedTuple, Union

from fsg._src.errors import ArgumentError
from fsg._src.pipeline.actions import Action, Schedule


class Cost(NamedTuple):
    """Durations of one stage's actions on one microbatch (any unit), and the latency of a
    point-to-point transfer. The default counts a full backward as twice a forward, split in
    equal halves between the input gradient ``B`` and the weight gradient ``W``."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0


Durations = Union[Cost, Mapping[Action, float], Callable[[Action], float]]


class Event(NamedTuple):
    """One action on a rank's timeline: when it started and ended."""

    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Each rank's events in the order it ran them.

    Attributes:
      schedule: the schedule played.
      events: ``events[rank]``, that rank's ``Event``s.
    """

    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]

    @property
    def makespan(self) -> float:
        """From the first start to the last end, over every rank."""
        starts = [e.start for rank in self.events for e in rank]
        return max(e.end for rank in self.events for e in rank) - min(starts) if starts else 0.0

    def busy(self, rank: int) -> float:
        """The time ``rank`` spent computing."""
        return sum(e.end - e.start for e in self.events[rank])

    @property
    def bubble(self) -> float:
        """The idle fraction of all ranks' time over the makespan: ``1 - busy / (pp * makespan)``."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(len(self.events))) / (len(self.events) * span)

    def draw(self, path: str, *, title: str | None = None) -> None:
        """Draws the timeline as a PNG at ``path``: one row per rank, one box per action
        (forward, input gradient, weight gradient in three colours, labelled by microbatch).
        Needs matplotlib (``pip install matplotlib``)."""
        from fsg._src.pipeline.drawing import draw

        draw(self, path, title=title)


def simulate(schedule: Schedule, cost: Durations | None = None) -> Timeline:
    """Plays ``schedule`` with the durations ``cost`` and returns its ``Timeline``.

    Args:
      schedule: a ``Schedule`` (``make_schedule``).
      cost: a ``Cost`` (durations by kind, and the p2p latency), a mapping from each
        ``Action`` to its duration, or a function of the action; default ``Cost()``.

    Returns:
      The ``Timeline``; ``.bubble`` is the predicted bubble fraction.

    Raises:
      ArgumentError: the per-rank orders deadlock (an action waits on one that cannot run
        first); the message names each blocked rank's action and what it waits for.

    Example:
      >>> from fsg._src.pipeline.schedules import make_schedule
      >>> round(simulate(make_schedule("gpipe", 2, 2)).bubble, 3)
      0.333
    """
    duration, latency = _durations(cost if cost is not None else Cost())
    pp = schedule.pp
    finished: dict[Action, float] = {}
    position, free = [0] * pp, [0.0] * pp
    events: list[list[Event]] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            actions = schedule.actions[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needs = schedule.dependencies(action)
                if any(d not in finished for d in needs):
                    break
                arrivals = [finished[d] + (latency if schedule.rank_of(d.stage) != rank else 0.0) for d in needs]
                start = max([free[rank], *arrivals])
                end = start + duration(action)
                finished[action] = free[rank] = end
                events[rank].append(Event(action, start, end))
                position[rank] += 1
                progress = True
    blocked = [(r, schedule.actions[r][position[r]]) for r in range(pp) if position[r] < len(schedule.actions[r])]
    if blocked:
        shown = "; ".join(
            f"rank {r} at {a!r} waits for {', '.join(repr(d) for d in schedule.dependencies(a) if d not in finished)}"
            for r, a in blocked
        )
        raise ArgumentError(
            f"pipeline schedule {schedule.name!r} deadlocks: {shown}. Each rank runs its actions in order, so an "
            f"action may only wait on actions that come earlier on their own ranks; reorder the rank lists"
        )
    return Timeline(schedule, tuple(tuple(e) for e in events))


def _durations(cost: Durations) -> tuple[Callable[[Action], float], float]:
    if isinstance(cost, Cost):
        by_kind = {"F": cost.forward, "B": cost.backward_input, "W": cost.backward_weight}
        return (lambda a: by_kind[a.kind]), cost.p2p
    if isinstance(cost, Mapping):
        return (lambda a: cost[a]), 0.0
    if callable(cost):
        return cost, 0.0
    raise ArgumentError(
        f"simulate(cost=...) takes a Cost, a mapping from Action to duration or a function; got {cost!r}"
    )
