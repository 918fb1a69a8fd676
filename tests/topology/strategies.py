"""Hypothesis strategies for described topologies and meshes that fit them."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from fsg._src.topology.description import Topology


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def topology_strategy(draw, max_gpus: int = 256):
    """A regular cluster: nodes of 1-8 GPUs, optional racks (the last may be partial) and pods."""
    gpus = draw(st.sampled_from([1, 2, 4, 8, 6]))
    nodes = draw(st.integers(1, max(1, max_gpus // gpus)))
    per_rack = draw(st.one_of(st.none(), st.integers(1, max(1, nodes))))
    per_pod = draw(st.one_of(st.none(), st.integers(1, 4))) if per_rack else None
    return Topology.regular(nodes=nodes, gpus_per_node=gpus, nodes_per_rack=per_rack, racks_per_pod=per_pod)


@st.composite
def axes_strategy(draw, world: int, gpus_per_node: int):
    """``{dp, fsdp, tp}`` multiplying to ``world``, tp dividing a node half of the time."""
    fits = [d for d in _divisors(gpus_per_node) if world % d == 0]
    tp = draw(st.sampled_from(fits)) if draw(st.booleans()) else draw(st.sampled_from(_divisors(world)))
    fsdp = draw(st.sampled_from(_divisors(world // tp)))
    axes = {"dp": world // tp // fsdp, "fsdp": fsdp, "tp": tp}
    names = draw(st.permutations(list(axes)))
    out = {n: axes[n] for n in names}
    assert math.prod(out.values()) == world
    return out
