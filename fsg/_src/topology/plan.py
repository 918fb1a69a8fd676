"""``plan``: a step's communication on a described cluster, for each candidate mesh.

For every candidate mesh and placement (``Mesh.from_topology``'s packing, and naive row-major):
the bytes each link level carries per step, the predicted time of each axis's collectives
(``cost.CostModel`` over the widest level each axis spans), what the step's compute could
hide, and the bytes that cross racks. Collectives on data axes (``dp``, ``fsdp``) can run
under the forward and backward; those on ``tp``, ``cp``, ``sp``, ``ep`` sit on the critical
path. The ranking is by predicted step time (compute + exposed communication); these are
model predictions, not measurements.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from fsg._src.errors import TopologyError
from fsg._src.topology import placement, traffic
from fsg._src.topology.cost import CostModel, kind_of
from fsg._src.topology.description import Topology
from fsg._src.topology.workload import GPTConfig

BLOCKING_AXES = ("tp", "cp", "sp", "ep", "pp")  # pp: a microbatch's stage waits for its activations


class AxisCost(NamedTuple):
    """One mesh axis's collectives in a plan."""

    axis: str
    size: int
    level: str  # the widest level its groups span ("-" for size 1)
    bytes_per_rank: float  # the collectives' full buffers, per rank per step
    seconds: float
    blocking: bool


class Candidate(NamedTuple):
    """One mesh and placement, with its predicted communication per step."""

    axes: dict
    strategy: str  # "packed" (Mesh.from_topology) or "row-major"
    per_axis: tuple  # AxisCost per axis
    level_bytes: dict  # {level: bytes over that level's links, whole cluster, per step}
    cross_rack_bytes: float
    comm_s: float
    hidden_s: float  # what compute could hide (data-axis collectives, up to compute_s)
    exposed_s: float
    compute_s: float | None

    @property
    def step_s(self) -> float:
        return (self.compute_s or 0.0) + self.exposed_s

    def describe(self) -> str:
        mesh = " x ".join(f"{a}={n}" for a, n in self.axes.items())
        return f"{mesh} ({self.strategy})"


class Plan(NamedTuple):
    """Candidates ranked best first, the ones refused (mesh, why), and the reason for the best."""

    ranked: tuple
    refused: tuple
    reason: str
    topology: Topology

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def as_text(self, top: int = 5) -> str:
        from fsg._src.topology.report import plan_text

        return plan_text(self, top)


def factorizations(
    world: int, axes: Sequence[str] = ("dp", "fsdp", "tp"), *, max_tp: int = 64, max_pp: int = 16
) -> list[dict]:
    """Every mesh over ``axes`` whose sizes multiply to ``world`` (``tp <= max_tp``, ``pp <=
    max_pp``; an axis of size 1 left out after the first)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for sizes in itertools.product(divisors, repeat=len(axes) - 1):
        rest = world // math.prod(sizes) if world % math.prod(sizes) == 0 else 0
        cand = dict(zip(axes, (rest, *sizes)))
        if rest and cand.get("tp", 1) <= max_tp and cand.get("pp", 1) <= max_pp:
            out.append(cand if "pp" not in cand or cand["pp"] > 1 else {a: n for a, n in cand.items() if a != "pp"})
    return out


def _rows(source, axes: dict) -> list[tuple[str, str, float, int]]:
    if isinstance(source, GPTConfig):
        return source.collectives(axes)
    rows = source.collectives() if callable(getattr(source, "collectives", None)) else source
    if not isinstance(rows, Sequence):
        raise TopologyError(
            f"plan(source) is {type(source).__name__}; give a Lowered, its collectives() or a GPTConfig"
        )
    for row in rows:
        if len(row) != 4:
            raise TopologyError(f"collective row {row!r} is not (kind, axis, bytes, count)")
        for name in str(row[1]).split("+"):
            if name not in axes:
                raise TopologyError(f"collective {row[0]} runs on axis {row[1]!r}, which mesh {axes} lacks")
    return [tuple(r) for r in rows]


def evaluate(source, axes: dict, ranks: np.ndarray, topology: Topology, model: CostModel,
             strategy: str, compute_s: float | None) -> Candidate:  # fmt: skip
    """The predicted communication of ``source``'s collectives on this placement."""
    names = list(axes)
    level_bytes = np.zeros(len(topology.levels))
    per_axis = {a: [0.0, 0.0] for a in names}
    for kind, axis, nbytes, count in _rows(source, axes):
        kind = kind_of(kind)
        if "+" in axis or count == 0:  # a collective over several axes: charge the outermost
            axis = axis.split("+")[0]
        i = names.index(axis)
        n = axes[axis]
        full = nbytes * (n if kind == "all_gather" else 1)  # an all-gather's input is its shard
        span = traffic.span_level(topology, ranks, i)
        link = topology.levels[max(span, 0)].link
        per_axis[axis][0] += full
        per_axis[axis][1] += count * model.time(kind, n, full / max(count, 1), link)
        level_bytes += traffic.level_fractions(topology, ranks, i, kind) * full
    costs = []
    for a in names:
        span = traffic.span_level(topology, ranks, names.index(a))
        level = topology.level_names[span] if span >= 0 else "-"
        costs.append(AxisCost(a, axes[a], level, per_axis[a][0], per_axis[a][1], a in BLOCKING_AXES))
    blocking = sum(c.seconds for c in costs if c.blocking)
    hideable = sum(c.seconds for c in costs if not c.blocking)
    hidden = min(hideable, compute_s) if compute_s is not None else 0.0
    cut = traffic.above(topology, "rack")
    return Candidate(
        dict(axes), strategy, tuple(costs), dict(zip(topology.level_names, level_bytes.tolist())),
        float(level_bytes[cut].sum()), blocking + hideable, hidden, blocking + hideable - hidden, compute_s,
    )  # fmt: skip


def plan(source, candidates, topology: Topology, *, model: CostModel | None = None,
         compute_s: float | None = None) -> Plan:  # fmt: skip
    """Predicts a step's communication on ``topology`` for each candidate mesh, and ranks them.

    Args:
      source: the step's collectives: a ``Lowered`` (``step.lower(state, batch)``), its
        ``collectives()`` rows ``(kind, axis, bytes, count)``, or a ``GPTConfig`` (estimated
        from the model's size for any mesh).
      candidates: ``{axis: size}`` dicts (or one dict, or an ``fsg.Mesh``); ``None`` with a
        ``GPTConfig``: every ``dp x fsdp x tp`` factorization of the cluster. A ``Lowered``'s
        collectives are per rank of the mesh it was lowered on: give that mesh's sizes.
      topology: the cluster.
      model: the collective cost model; default ``CostModel()`` (the issue's H200 figures).
      compute_s: the step's compute time, to say what overlap could hide; default from the
        ``GPTConfig``, else none is hidden.

    Returns:
      a ``Plan``: ``.best``, ``.ranked`` (each with ``.level_bytes``, ``.cross_rack_bytes``,
      ``.exposed_s``), ``.reason``, ``.as_text()``.

    Example:
      >>> topo = Topology.regular(nodes=4, gpus_per_node=8, nodes_per_rack=2)
      >>> rows = [("all_reduce", "tp", 1 << 30, 8), ("all_reduce", "dp", 1 << 28, 4)]
      >>> p = plan(rows, {"dp": 4, "tp": 8}, topo)
      >>> [(c.axis, c.level) for c in p.best.per_axis]
      [('dp', 'cluster'), ('tp', 'node')]
    """
    if not isinstance(topology, Topology):
        raise TopologyError(f"plan(topology=...) is {type(topology).__name__}; give an fsg Topology")
    model = model or CostModel()
    if candidates is None:
        if not isinstance(source, GPTConfig):
            raise TopologyError("plan(candidates=None) needs a GPTConfig source; give the mesh a Lowered ran on")
        candidates = factorizations(topology.world_size, ("dp", "fsdp", "tp", "pp"))
    elif isinstance(candidates, Mapping):
        candidates = [candidates]
    elif hasattr(candidates, "axis_names") and hasattr(candidates, "shape"):  # an fsg.Mesh
        candidates = [dict(zip(candidates.axis_names, candidates.shape))]
    given = compute_s
    ranked, refused = [], []
    for axes in candidates:
        axes = placement.check_axes(axes, topology)
        why = source.check_mesh(axes) if isinstance(source, GPTConfig) else None
        if why is not None:
            refused.append((axes, why))
            continue
        compute_s = given  # a GPTConfig's: per mesh (a pipeline's bubble stretches it)
        if compute_s is None and isinstance(source, GPTConfig):
            compute_s = source.compute_s(topology.world_size, axes)
        # Axes with known names keep the order (tp > fsdp/cp > dp: a tensor-parallel byte is
        # on the critical path, an FSDP byte can hide under compute); others go by their bytes.
        known = all(a in placement.DEFAULT_TRAFFIC for a in axes)
        packed = placement.place(axes, topology, traffic=None if known else _axis_traffic(source, axes))
        ranked.append(evaluate(source, axes, packed.ranks, topology, model, packed.strategy, compute_s))
        naive = placement.row_major(axes)
        ranked.append(evaluate(source, axes, naive, topology, model, "row-major", compute_s))
    if not ranked:
        raise TopologyError(
            f"no candidate mesh can be placed: {refused[0][0]} {refused[0][1]} (and {len(refused) - 1} more)"
        )
    ranked.sort(key=lambda c: (round(c.step_s, 9), c.cross_rack_bytes, c.strategy != "packed"))
    from fsg._src.topology.report import reason

    return Plan(tuple(ranked), tuple(refused), reason(ranked), topology)


def _axis_traffic(source, axes: dict) -> dict:
    """Per axis, its collectives' bytes per rank (for ordering the placement)."""
    out = {a: 0.0 for a in axes}
    for kind, axis, nbytes, _ in _rows(source, axes):
        axis = axis.split("+")[0]
        out[axis] += nbytes * (axes[axis] if kind_of(kind) == "all_gather" else 1)
    return {a: (w if w > 0 else placement.DEFAULT_TRAFFIC.get(a, 10.0) * 1e-9) for a, w in out.items()}
