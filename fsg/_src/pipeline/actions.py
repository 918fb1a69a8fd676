"""A pipeline schedule as data: each rank's ordered list of actions on (stage, microbatch).

Legend: ``F(s, m)`` is stage ``s``'s forward of microbatch ``m``; ``B(s, m)`` its backward
with respect to the stage's activation inputs (the input gradient it sends to stage ``s - 1``);
``W(s, m)`` its backward with respect to the stage's parameters (the weight gradient, which
stays on the rank). Stage ``s`` lives on rank ``s % pp`` (Megatron's and
``torch.distributed.pipelining``'s loop placement: with ``v`` virtual stages a rank holds
stages ``r, r + pp, ..., r + (v - 1) pp``).

What an action needs is a function of the stage graph alone: ``F(s, m)`` the activations of
``F(s - 1, m)``; ``B(s, m)`` its own ``F(s, m)`` and the input gradient of ``B(s + 1, m)``;
``W(s, m)`` its own ``B(s, m)``. Where the two ends sit on different ranks the dependency is a
point-to-point transfer (``Schedule.transfers``). A schedule with ``full_backward`` (GPipe,
1F1B, interleaved) runs each ``W`` right after its ``B`` and sends the input gradient only
after both, as a single backward pass does: there ``B(s, m)`` waits for ``W(s + 1, m)``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple

KINDS = ("F", "B", "W")


class Action(NamedTuple):
    """One unit of a schedule: ``kind`` (``"F"``, ``"B"`` or ``"W"``) of ``stage`` on ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


class Transfer(NamedTuple):
    """A point-to-point message: what ``producer`` computed, sent from ``src`` to ``dst`` for ``consumer``."""

    src: int
    dst: int
    producer: Action
    consumer: Action


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Each rank's ordered actions for ``num_microbatches`` microbatches over ``pp * virtual`` stages.

    Attributes:
      name: the schedule's name (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zbh1"``).
      pp: the number of pipeline ranks.
      virtual: stages per rank.
      num_microbatches: microbatches per step.
      actions: ``actions[rank]``, that rank's actions in the order it runs them.
      full_backward: the input gradient leaves the rank after the weight gradient (one
        backward pass); else right after ``B`` (zero-bubble schedules).
    """

    name: str
    pp: int
    virtual: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    full_backward: bool = True

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in pipeline order."""
        return tuple(range(rank, self.num_stages, self.pp))

    def dependencies(self, action: Action) -> list[Action]:
        """The actions whose results ``action`` reads."""
        kind, s, m = action
        last = self.num_stages - 1
        if kind == "F":
            return [Action("F", s - 1, m)] if s > 0 else []
        if kind == "B":
            upstream = "W" if self.full_backward else "B"
            return [Action("F", s, m)] + ([Action(upstream, s + 1, m)] if s < last else [])
        return [Action("B", s, m)]

    def transfers(self) -> Iterator[Transfer]:
        """The point-to-point messages the schedule implies: activations forward (``F`` to
        ``F``), input gradients backward (``B``, or ``W`` under ``full_backward``, to ``B``), in
        the order each sender runs."""
        sends_gradient = "W" if self.full_backward else "B"
        for rank, actions in enumerate(self.actions):
            for a in actions:
                if a.kind == "F" and a.stage < self.num_stages - 1:
                    consumer = Action("F", a.stage + 1, a.microbatch)
                elif a.kind == sends_gradient and a.stage > 0:
                    consumer = Action("B", a.stage - 1, a.microbatch)
                else:
                    continue
                dst = self.rank_of(consumer.stage)
                if dst != rank:
                    yield Transfer(rank, dst, a, consumer)
