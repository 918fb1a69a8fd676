"""Which links a mesh axis's collectives use: per axis, how its bytes split over the levels.

A ring collective (all-reduce, all-gather, reduce-scatter) over a group passes its data along
``n`` edges, the group's ranks in topology order; an edge between two ranks uses the link of
the smallest domain holding both. An all-to-all sends ``1/n`` of its buffer to every other
member. NCCL also builds trees and splits rings across NICs; this is the first-order picture
those refine, and it is exact about which bytes cross a rack.
"""

from __future__ import annotations

import numpy as np

from fsg._src.topology.description import Topology
from fsg._src.topology.levels import LEVEL_NAMES

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def groups(ranks: np.ndarray, axis: int) -> np.ndarray:
    """The rank groups of mesh axis ``axis``: ``[groups, axis size]``."""
    return np.moveaxis(ranks, axis, -1).reshape(-1, ranks.shape[axis])


def ring_edges(topology: Topology, groups_GN: np.ndarray) -> np.ndarray:
    """Per level, how many ring edges of all the groups use that level's link: ``[levels]``."""
    n = groups_GN.shape[1]
    levels = len(topology.levels)
    if n == 1:
        return np.zeros(levels, dtype=np.int64)
    position = np.empty(topology.world_size, dtype=np.int64)
    position[topology.order()] = np.arange(topology.world_size)
    ring = np.take_along_axis(groups_GN, np.argsort(position[groups_GN], axis=1), axis=1)
    a, b = ring, np.roll(ring, -1, axis=1)
    lvl = topology.common_level(a, b).ravel()
    return np.bincount(lvl, minlength=levels)[:levels]


def pair_counts(topology: Topology, groups_GN: np.ndarray) -> np.ndarray:
    """Per level, how many ordered pairs of distinct members of a group (over all groups) have it
    as their smallest shared domain: ``[levels]``."""
    g, n = groups_GN.shape
    levels = len(topology.levels)
    within = np.zeros(levels, dtype=np.float64)  # within[l]: ordered pairs sharing a level-l domain
    for lvl in range(levels):
        ids = topology.ids[groups_GN, lvl]  # [G, n]
        _, inverse = np.unique(ids + np.arange(g)[:, None] * (ids.max() + 1), return_inverse=True)
        within[lvl] = float((np.bincount(inverse.ravel()).astype(np.float64) ** 2).sum())
    exact = np.diff(np.concatenate([[g * n], within]))  # pairs whose smallest shared level is l
    return exact


def level_fractions(topology: Topology, ranks: np.ndarray, axis: int, kind: str) -> np.ndarray:
    """Per level, the bytes over that level's links for one collective on ``axis`` whose full
    buffer is one byte per rank group member (all-gather output / reduce-scatter input / the
    all-reduced buffer), summed over the whole cluster: ``[levels]``.

    Multiply by the full buffer size ``S`` for bytes. A ring all-gather or reduce-scatter puts
    ``(n-1)/n * S`` on every edge, an all-reduce twice that; an all-to-all ``S/n`` per pair.
    """
    n = ranks.shape[axis]
    grp = groups(ranks, axis)
    if n == 1:
        return np.zeros(len(topology.levels))
    if kind == "all_to_all":
        return pair_counts(topology, grp) / n
    if kind == "send_recv":  # a chain of stages: a rank's message on one edge, n - 1 of the ring's n edges
        return ring_edges(topology, grp) * (n - 1) / n
    per_edge = (n - 1) / n * (2.0 if kind == "all_reduce" else 1.0)
    return ring_edges(topology, grp) * per_edge


def span_level(topology: Topology, ranks: np.ndarray, axis: int) -> int:
    """The largest level any group of ``axis`` spans (-1 for an axis of size 1)."""
    if ranks.shape[axis] == 1:
        return -1
    return int(topology.span_level(groups(ranks, axis)).max())


def above(topology: Topology, level: str) -> slice:
    """The slice of levels whose links join different domains of ``level`` (``"rack"``: the
    cross-rack links). Without that level: the levels outside it (``"pod"``, ``"cluster"``)."""
    rank = LEVEL_NAMES.index(level)
    first = next((i for i, n in enumerate(topology.level_names) if LEVEL_NAMES.index(n) > rank), None)
    return slice(len(topology.levels), None) if first is None else slice(first, None)
