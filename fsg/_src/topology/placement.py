"""Placing mesh axes on a topology: the rank tensor ``Mesh.from_topology`` builds on.

The axis with the most traffic is packed first, into the smallest domains: its groups are
formed inside each NVLink domain, then inside each node from what the domains left over, then
inside each rack, and so on (hierarchical packing). The groups become the units the next
axis packs the same way. With traffic ``tp > fsdp > dp`` on 8-GPU nodes in racks, ``tp=8``
fills nodes, FSDP groups stay inside a rack when they fit, and data parallel goes across racks.

The result is a pure function of the topology and the axes, so every rank computes the same
permutation. As a guard, the packing is compared with naive row-major placement (``arange``
over the user's axis order, what ``init_device_mesh`` does) and never moves more traffic
across racks than it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from fsg._src.errors import TopologyError
from fsg._src.topology import traffic as links
from fsg._src.topology.description import Topology
from fsg._src.topology.levels import check_level_name

# Default traffic per axis name when none is given: tensor parallel > FSDP / context / expert >
# data parallel (per step, relative).
# pp last: its point-to-point activations are the least traffic, the axis to place across racks
DEFAULT_TRAFFIC = {"tp": 100.0, "cp": 10.0, "sp": 10.0, "ep": 10.0, "fsdp": 10.0, "dp": 1.0, "pp": 0.1}


class Placement(NamedTuple):
    """Where a mesh's axes sit.

    Attributes:
      axes: ``{name: size}`` in the user's order.
      ranks: an int64 array of shape ``axes.values()``: the rank at each mesh coordinate.
      order: the axis names innermost (most traffic) first, as packed.
      strategy: ``"packed"`` or ``"row-major"`` (when the guard kept naive placement).
    """

    axes: dict
    ranks: np.ndarray
    order: tuple
    strategy: str


def check_axes(axes: object, topology: Topology) -> dict:
    if not isinstance(axes, Mapping) or not axes:
        raise TopologyError(f"axes is {axes!r:.60}; give a dict {{name: size}}, e.g. {{'dp': 4, 'tp': 8}}")
    for name, size in axes.items():
        if not isinstance(name, str) or not name or isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise TopologyError(f"axes[{name!r}] = {size!r}; axes map non-empty names to ints >= 1")
    size = math.prod(axes.values())
    if size > topology.world_size:
        raise TopologyError(
            f"the mesh {dict(axes)} has {size} devices but the cluster has {topology.world_size} GPUs "
            f"({topology!r}); shrink an axis so the sizes multiply to {topology.world_size}"
        )
    if size < topology.world_size:
        raise TopologyError(
            f"the mesh {dict(axes)} has {size} devices but the cluster has {topology.world_size} GPUs; "
            f"a mesh covers the whole job: grow an axis (e.g. dp) so the sizes multiply to {topology.world_size}"
        )
    return dict(axes)


def traffic_order(axes: dict, traffic: Mapping[str, float] | None) -> tuple:
    """Axis names, most traffic first; ties keep the later axis inner (as row-major does)."""
    if traffic is None:
        weights = {a: DEFAULT_TRAFFIC.get(a, 10.0) for a in axes}
    else:
        if not isinstance(traffic, Mapping):
            raise TopologyError(f"traffic is {traffic!r:.60}; give {{axis: bytes per step}}")
        missing = [a for a in axes if a not in traffic]
        extra = [a for a in traffic if a not in axes]
        if missing or extra:
            which = f"lacks axis {missing[0]!r}" if missing else f"names axis {extra[0]!r}, not in the mesh"
            raise TopologyError(f"traffic {which}; give one figure per mesh axis {list(axes)}")
        for a, w in traffic.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
                raise TopologyError(f"traffic[{a!r}] is {w!r}; traffic is a number of bytes >= 0")
        weights = dict(traffic)
    names = list(axes)
    return tuple(sorted(names, key=lambda a: (-weights[a], -names.index(a))))


def _pack(topology: Topology, units: list[np.ndarray], size: int) -> list[np.ndarray]:
    """Groups of ``size`` consecutive units, formed in the smallest domains first."""
    ids = topology.ids
    top = len(topology.levels) - 1
    formed: list[np.ndarray] = []

    def shared(unit: np.ndarray, lvl: int) -> int:
        col = ids[unit.ravel(), lvl]
        return int(col[0]) if (col == col[0]).all() else -1

    def rec(members: list[np.ndarray], lvl: int) -> list[np.ndarray]:
        pool: list[np.ndarray] = []
        if lvl > 0:
            children: dict[int, list[np.ndarray]] = {}
            spanning = []
            for u in members:
                d = shared(u, lvl - 1)
                (spanning.append(u) if d < 0 else children.setdefault(d, []).append(u))
            for child in children.values():
                pool += rec(child, lvl - 1)
            pool += spanning
        else:
            pool = members
        whole = len(pool) - len(pool) % size
        formed.extend(np.stack(pool[i : i + size]) for i in range(0, whole, size))
        return pool[whole:]

    left = rec(units, top)
    assert not left, "the world divides by every axis size"
    return formed


def packed(topology: Topology, axes: dict, order: tuple) -> np.ndarray:
    """The rank tensor (shape ``axes.values()``) of hierarchical packing in ``order``."""
    units = [np.array(r) for r in topology.order()]
    for name in order:
        units = _pack(topology, units, axes[name])
    ranks = units[0]  # dims: outermost packed axis first ... innermost last
    packed_dims = list(reversed(order))
    return np.ascontiguousarray(np.transpose(ranks, [packed_dims.index(a) for a in axes]))


def row_major(axes: dict) -> np.ndarray:
    """Naive placement: ``arange(world).reshape(sizes)``, as ``init_device_mesh`` does."""
    return np.arange(math.prod(axes.values())).reshape(tuple(axes.values()))


def cross_rack(topology: Topology, ranks: np.ndarray, axes: dict, weights: Mapping[str, float]) -> float:
    """Weighted bytes over links that join racks (all-reduce traffic ``weights[axis]`` per axis)."""
    out = 0.0
    cut = links.above(topology, "rack")
    for i, name in enumerate(axes):
        out += weights[name] * links.level_fractions(topology, ranks, i, "all_reduce")[cut].sum()
    return out


def place(axes: Mapping[str, int], topology: Topology, *, traffic: Mapping[str, float] | None = None,
          within: Mapping[str, str] | None = None) -> Placement:  # fmt: skip
    """Places ``axes`` on ``topology``: most traffic in the smallest domains.

    Args:
      axes: ``{name: size}``; the sizes multiply to the topology's GPU count.
      traffic: ``{axis: bytes per step}`` (relative is fine); default ``tp > fsdp/cp/ep > dp``.
      within: ``{axis: level}``: each group of that axis must lie inside one domain of
        ``level`` (e.g. ``{"tp": "node"}``); raises ``TopologyError`` when it cannot.

    Returns:
      a ``Placement``.
    """
    if not isinstance(topology, Topology):
        raise TopologyError(f"topology is {type(topology).__name__}; give an fsg Topology (Topology.load(...))")
    axes = check_axes(axes, topology)
    order = traffic_order(axes, traffic)
    weights = dict(traffic) if traffic is not None else {a: DEFAULT_TRAFFIC.get(a, 10.0) for a in axes}
    ranks, strategy = packed(topology, axes, order), "packed"
    naive = row_major(axes)
    if cross_rack(topology, naive, axes, weights) < cross_rack(topology, ranks, axes, weights):
        ranks, strategy = naive, "row-major"
    for name, level in (within or {}).items():
        if name not in axes:
            raise TopologyError(f"within names axis {name!r}, which the mesh {axes} does not have")
        check_level_name(level, f"within[{name!r}]")
        limit = topology.level_index(level)
        if limit is None:
            raise TopologyError(f"within[{name!r}] is {level!r}, a level this topology lacks: {topology!r}")
        span = links.span_level(topology, ranks, list(axes).index(name))
        if span > limit:
            sizes = np.bincount(topology.ids[:, limit])
            raise TopologyError(
                f"axis {name!r} of size {axes[name]} cannot be placed within one {level}: the {level} domains "
                f"hold {sizes.min()}-{sizes.max()} GPUs and its groups span a {topology.level_names[span]}; "
                f"make {name!r} a divisor of {int(sizes.min())}, or allow a larger level in within="
            )
    return Placement(axes, ranks.astype(np.int64), order, strategy)
