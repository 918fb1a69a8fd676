"""The link levels of a cluster, innermost first, and their default links.

A level is a kind of domain that holds GPUs: an NVLink domain, a node, a rack (the GPUs behind
one leaf switch), a pod (behind one spine), the whole cluster. Domains nest: every NVLink domain
lies in one node, every node in one rack, and so on. Two GPUs talk over the link of the
smallest domain they share: two GPUs of one node over NVLink, of two nodes of one rack through
the leaf switch, of two racks through the spine.

The default links are assumptions, not measurements, for an H200 cluster with one 400 Gb/s
NIC per GPU: the NVLink figures are the issue's two-H200 peak (calibrate them with
``benchmarks/collectives.py``); the network figures assume a rail-optimized fat tree that is
non-blocking inside a rack, 2:1 oversubscribed between racks and 4:1 between pods.
"""

from __future__ import annotations

from typing import NamedTuple

from fsg._src.errors import TopologyError

# Innermost first. A description names a subset of these, in this order.
LEVEL_NAMES = ("nvlink", "node", "rack", "pod", "cluster")


class Link(NamedTuple):
    """How fast GPUs whose smallest shared domain is this level talk.

    Attributes:
      bandwidth_GBps: bus bandwidth per GPU in GB/s (nccl-tests' ``busbw``: what a ring
        collective sustains per GPU at large messages).
      latency_us: the latency of one step of a collective over this link (one ring hop, or
        one level of a tree), in microseconds.
    """

    bandwidth_GBps: float
    latency_us: float


class Level(NamedTuple):
    """One level of a topology: its name (one of ``LEVEL_NAMES``) and its link."""

    name: str
    link: Link


DEFAULT_LINKS = {
    "nvlink": Link(335.0, 1.5),  # the peak bus bandwidth on two H200s
    "node": Link(335.0, 1.5),  # an H200 node is one NVLink (NVSwitch) domain of 8 GPUs
    "rack": Link(45.0, 6.0),  # 400 Gb/s NDR per GPU through the leaf switch, ~90% of line rate
    "pod": Link(22.5, 8.0),  # spine, 2:1 oversubscribed
    "cluster": Link(11.0, 10.0),  # core, 4:1 oversubscribed
}
# The node level's default when the topology has an nvlink level: then the node link joins
# NVLink domains (or lone GPUs) of one node, over PCIe Gen5 x16 through the host (an assumption,
# uncalibrated, as every default here but the two-H200 NVLink figure).
NODE_LINK_BETWEEN_NVLINK_DOMAINS = Link(24.0, 4.0)


def check_level_name(name: object, where: str) -> str:
    """``name`` if it is a known level, else a ``TopologyError`` naming ``where``."""
    if name not in LEVEL_NAMES:
        raise TopologyError(
            f"{where} is {name!r}, which is not a topology level; levels are {', '.join(LEVEL_NAMES)} "
            f"(innermost first: a rack is the GPUs behind one leaf switch, a pod those behind one spine)"
        )
    return name


def check_level_order(names: list[str], where: str) -> None:
    """Raises unless ``names`` are distinct known levels, innermost first."""
    for i, name in enumerate(names):
        check_level_name(name, f"{where}[{i}]")
    if len(set(names)) != len(names) or names != sorted(names, key=LEVEL_NAMES.index):
        raise TopologyError(
            f"{where} is {names}: levels are distinct and innermost first; write them in the order "
            f"{[n for n in LEVEL_NAMES if n in names]}"
        )


def link_from(value: object, where: str) -> Link:
    """A ``Link`` from a ``Link``, a mapping ``{bandwidth_GBps, latency_us}`` or a pair."""
    if isinstance(value, Link):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(Link._fields)
        if unknown:
            raise TopologyError(f"{where} has unknown field(s) {sorted(unknown)}; a link has {list(Link._fields)}")
        missing = set(Link._fields) - set(value)
        if missing:
            raise TopologyError(f"{where} lacks {sorted(missing)}; a link has {list(Link._fields)}")
        value = (value["bandwidth_GBps"], value["latency_us"])
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise TopologyError(f"{where} is {value!r}; give a link as {{bandwidth_GBps: 45, latency_us: 6}}")
    for field, v in zip(Link._fields, value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
            raise TopologyError(f"{where}.{field} is {v!r}; it must be a positive finite number")
    return Link(float(value[0]), float(value[1]))
