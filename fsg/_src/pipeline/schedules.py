"""The pipeline schedules, as each rank's ordered list of ``F``/``B``/``W`` actions.

- ``gpipe`` (Huang et al. 2019): every forward, then every backward. Memory grows with the
  microbatch count (all activations live at once).
- ``1f1b`` (PipeDream-Flush; Narayanan et al. 2021): rank ``r`` runs ``pp - r - 1`` warm-up
  forwards, then alternates one forward and one backward, then drains the backwards. At most
  ``pp - r`` microbatches are in flight on rank ``r``.
- ``interleaved`` (Megatron's interleaved 1F1B, Narayanan et al. 2021): ``v`` stages per rank,
  microbatches in rounds of ``pp``; ``(v - 1) pp + 2 (pp - r - 1)`` warm-up forwards. Megatron's
  form: the microbatch count is a multiple of ``pp``.
- ``zbh1`` (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order with the
  weight gradient ``W`` split from the input gradient ``B`` and deferred: rank ``r`` holds back
  its first ``r`` ``W``s, which then fill the drain where 1F1B idles. At most ``pp``
  microbatches are in flight (1F1B's peak memory). The order is that of
  ``torch.distributed.pipelining``'s ``ScheduleInterleavedZeroBubble`` with one stage a rank.

GPipe, 1F1B and interleaved run a full backward: their ``W`` follows its ``B`` at once, and
the input gradient is sent after both (``Schedule.full_backward``).
"""

from __future__ import annotations

from typing import Callable

from fsg._src.errors import ArgumentError
from fsg._src.pipeline.actions import Action, Schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1")


def make_schedule(name: str, pp: int, num_microbatches: int, *, virtual: int = 1) -> Schedule:
    """The schedule ``name`` for ``pp`` ranks, ``virtual`` stages per rank and ``num_microbatches``.

    Args:
      name: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zbh1"``.
      pp: pipeline ranks (the ``pp`` axis's size).
      num_microbatches: microbatches per step (``accum_steps``).
      virtual: stages per rank; more than 1 for ``"interleaved"`` only.

    Returns:
      A ``Schedule``: ``schedule.actions[rank]`` is that rank's action list.

    Example:
      >>> s = make_schedule("1f1b", 2, 2)
      >>> s.actions[0]
      (F0.0, F0.1, B0.0, W0.0, B0.1, W0.1)
    """
    check(name, pp, num_microbatches, virtual)
    build: Callable[[int, int, int, int], list[Action]] = _BUILDERS[name]
    actions = tuple(tuple(build(rank, pp, num_microbatches, virtual)) for rank in range(pp))
    return Schedule(name, pp, virtual, num_microbatches, actions, full_backward=name != "zbh1")


def check(name: object, pp: object, num_microbatches: object, virtual: object) -> None:
    """Raises ``ArgumentError`` for a schedule that cannot be built, saying what it needs."""
    if name not in _BUILDERS:
        raise ArgumentError(f"pipeline schedule {name!r} is unknown; choose one of {SCHEDULES}")
    for what, value in (("pp", pp), ("num_microbatches (accum_steps)", num_microbatches), ("virtual_stages", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArgumentError(f"the pipeline's {what} is {value!r}; it must be an int >= 1")
    if name == "interleaved" and virtual < 2:
        raise ArgumentError(
            f"schedule 'interleaved' runs several stages per rank; virtual_stages={virtual}. Pass "
            f"virtual_stages=2 or more, or schedule='1f1b' for one stage per rank"
        )
    if name != "interleaved" and virtual != 1:
        raise ArgumentError(
            f"schedule {name!r} runs one stage per rank; virtual_stages={virtual}. Pass schedule='interleaved' "
            f"for several stages per rank, or virtual_stages=1"
        )
    if name in ("1f1b", "zbh1") and num_microbatches < pp:
        raise ArgumentError(
            f"schedule {name!r} on pp={pp} needs at least {pp} microbatches (one in flight per stage) and got "
            f"accum_steps={num_microbatches}; raise accum_steps to {pp} or more, or use schedule='gpipe'"
        )
    if name == "interleaved" and num_microbatches % pp:
        raise ArgumentError(
            f"schedule 'interleaved' (Megatron's form) runs microbatches in rounds of pp={pp}; accum_steps="
            f"{num_microbatches} is not a multiple of {pp}: make accum_steps a multiple of {pp}"
        )


def _gpipe(rank: int, pp: int, m: int, v: int) -> list[Action]:
    out = [Action("F", rank, j) for j in range(m)]
    for j in range(m):
        out += [Action("B", rank, j), Action("W", rank, j)]
    return out


def _one_f_one_b(rank: int, pp: int, m: int, v: int, *, zero_bubble: bool = False) -> list[Action]:
    warm = min(pp - rank - 1, m)
    out = [Action("F", rank, j) for j in range(warm)]
    f, b, w = warm, 0, 0
    # ZB-H1: rank r holds back its first r weight gradients; each later B releases the oldest
    held = rank if zero_bubble else 0

    def backward() -> None:
        nonlocal b, w
        out.append(Action("B", rank, b))
        b += 1
        if b > held:
            out.append(Action("W", rank, w))
            w += 1

    while f < m:
        out.append(Action("F", rank, f))
        f += 1
        backward()
    while b < m:
        backward()
    out += [Action("W", rank, j) for j in range(w, m)]
    return out


def _zbh1(rank: int, pp: int, m: int, v: int) -> list[Action]:
    return _one_f_one_b(rank, pp, m, v, zero_bubble=True)


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    total = m * v  # forwards on this rank (and backwards)
    warm = min((v - 1) * pp + 2 * (pp - rank - 1), total)

    def forward(k: int) -> Action:  # the k-th forward: rounds of pp microbatches, stage by stage
        local = (k // pp) % v
        return Action("F", local * pp + rank, (k // (pp * v)) * pp + k % pp)

    def backward(k: int) -> Action:  # the k-th backward: the stages in reverse
        local = v - 1 - (k // pp) % v
        return Action("B", local * pp + rank, (k // (pp * v)) * pp + k % pp)

    out = [forward(k) for k in range(warm)]
    b = 0
    for k in range(warm, total):
        out.append(forward(k))
        out += [backward(b), backward(b)._replace(kind="W")]
        b += 1
    for k in range(b, total):
        out += [backward(k), backward(k)._replace(kind="W")]
    return out


_BUILDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zbh1": _zbh1}
