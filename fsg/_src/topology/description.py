"""``Topology``: where each rank's GPU sits in the cluster's nested domains, and their links.

A topology is a list of levels (innermost first, the outermost holding every GPU) and, per
rank, the label of its domain at each level: ``("node-17", "rack-0", "all")``. Ranks are GPUs
in the order the job numbers them; a described cluster numbers them node by node, as
``torchrun`` does when every node starts the same number of processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fsg._src.errors import TopologyError
from fsg._src.topology.levels import (
    DEFAULT_LINKS,
    LEVEL_NAMES,
    NODE_LINK_BETWEEN_NVLINK_DOMAINS,
    Level,
    Link,
    check_level_name,
    check_level_order,
    link_from,
)


class Topology:
    """The GPUs of a cluster: nested domains (NVLink domain, node, rack, pod, cluster) with a
    link per level.

    Build one with ``Topology.regular`` (a described cluster), ``Topology.from_hostnames`` (a
    hostname per rank), ``Topology.load`` (a YAML/JSON file or a Slurm ``topology.conf``) or
    ``Topology.from_job`` (gathered from the running job).

    Args:
      level_names: the levels, innermost first (from ``"nvlink"``, ``"node"``, ``"rack"``,
        ``"pod"``, ``"cluster"``); the outermost must hold every rank.
      locations: per rank, the label of its domain at each level.
      links: ``{level: Link or {bandwidth_GBps, latency_us}}``; a level not named gets the
        default link of ``fsg._src.topology.levels.DEFAULT_LINKS`` (the node level, when an
        nvlink level lies inside it: ``NODE_LINK_BETWEEN_NVLINK_DOMAINS``, PCIe).

    Example:
      >>> topo = Topology.regular(nodes=4, gpus_per_node=8, nodes_per_rack=2)
      >>> topo
      Topology(32 GPUs: node 4 x 8, rack 2 x 16, cluster 1 x 32)
    """

    def __init__(
        self,
        level_names: Sequence[str],
        locations: Sequence[Sequence[object]],
        *,
        links: Mapping[str, object] | None = None,
    ):
        names = list(level_names)
        check_level_order(names, "levels")
        if not names:
            raise TopologyError("levels is empty; a topology has at least one level, e.g. ['node', 'cluster']")
        links = dict(links or {})
        for name in links:
            check_level_name(name, f"links key {name!r}")
            if name not in names:
                raise TopologyError(
                    f"links names level {name!r}, which this topology does not have; its levels are {names}"
                )
        defaults = dict(DEFAULT_LINKS)
        if "nvlink" in names:  # the node link then joins a node's NVLink domains: PCIe, not NVLink
            defaults["node"] = NODE_LINK_BETWEEN_NVLINK_DOMAINS
        self.levels = tuple(Level(n, link_from(links.get(n, defaults[n]), f"links.{n}")) for n in names)
        if not locations:
            raise TopologyError("a topology needs at least one GPU; the description has none")
        ids = np.zeros((len(locations), len(names)), dtype=np.int64)
        self.labels: list[list[object]] = [[] for _ in names]
        index: list[dict[object, int]] = [{} for _ in names]
        for rank, loc in enumerate(locations):
            if len(loc) != len(names):
                raise TopologyError(
                    f"rank {rank}'s location {tuple(loc)} has {len(loc)} labels; give one per level {names}"
                )
            for lvl, label in enumerate(loc):
                ids[rank, lvl] = index[lvl].setdefault(label, len(index[lvl]))
                if ids[rank, lvl] == len(self.labels[lvl]):
                    self.labels[lvl].append(label)
        for lvl in range(len(names) - 1):  # a domain lies in one domain of each level above
            parent = {}
            for rank in range(len(locations)):
                seen = parent.setdefault(ids[rank, lvl], ids[rank, lvl + 1])
                if seen != ids[rank, lvl + 1]:
                    raise TopologyError(
                        f"{names[lvl]} {self.labels[lvl][ids[rank, lvl]]!r} lies in two {names[lvl + 1]} domains "
                        f"({self.labels[lvl + 1][seen]!r} and {self.labels[lvl + 1][ids[rank, lvl + 1]]!r}, "
                        f"at rank {rank}); domains nest: give each {names[lvl]} one {names[lvl + 1]}"
                    )
        if len(self.labels[-1]) != 1:
            raise TopologyError(
                f"the outermost level {names[-1]!r} has {len(self.labels[-1])} domains, so some ranks share no "
                f"level; add an outer level (e.g. 'cluster') with the link that joins them"
            )
        self.ids = ids  # [world, levels]: domain index per level
        self.ids.setflags(write=False)

    @property
    def world_size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def level_names(self) -> tuple[str, ...]:
        return tuple(level.name for level in self.levels)

    def level_index(self, name: str) -> int | None:
        """The index of level ``name``, or ``None`` when this topology does not have it."""
        return self.level_names.index(name) if name in self.level_names else None

    def domains(self, level: str) -> int:
        """How many domains of ``level`` the cluster has."""
        i = self.level_index(level)
        if i is None:
            raise TopologyError(f"this topology has no level {level!r}; its levels are {list(self.level_names)}")
        return len(self.labels[i])

    def order(self) -> np.ndarray:
        """The ranks sorted so that each domain's ranks are contiguous (outermost level first,
        then the job's rank order): the order a placement fills."""
        keys = [np.arange(self.world_size)] + [self.ids[:, i] for i in range(len(self.levels))]
        return np.lexsort(keys)

    def common_level(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per pair, the index of the smallest level whose domain holds both ranks (-1: same rank)."""
        same = self.ids[a] == self.ids[b]  # [..., levels]; nested, so once equal, equal above
        return np.where(a == b, -1, len(self.levels) - same.sum(axis=-1))

    def span_level(self, groups: np.ndarray) -> np.ndarray:
        """Per group (rows of ``groups``), the index of the smallest level holding all its ranks."""
        loc = self.ids[groups]  # [G, n, levels]
        same = (loc == loc[:, :1]).all(axis=1)  # [G, levels]
        out = len(self.levels) - same.sum(axis=-1)
        return np.where(groups.shape[1] == 1, -1, out)

    def __repr__(self) -> str:
        parts = []
        for i, level in enumerate(self.levels):
            count = len(self.labels[i])
            sizes = np.bincount(self.ids[:, i])
            each = str(sizes[0]) if (sizes == sizes[0]).all() else f"{sizes.min()}-{sizes.max()}"
            parts.append(f"{level.name} {count} x {each}")
        return f"Topology({self.world_size} GPUs: {', '.join(parts)})"

    # Builders (their logic lives in builders.py; these are the documented entry points).
    @classmethod
    def regular(cls, *, nodes: int, gpus_per_node: int = 8, nodes_per_rack: int | None = None,
                racks_per_pod: int | None = None, nvlink_domain: int | None = None,
                links: Mapping[str, object] | None = None) -> Topology:  # fmt: skip
        """A described cluster: ``nodes`` nodes of ``gpus_per_node`` GPUs; racks of
        ``nodes_per_rack`` nodes (the last may be partial); pods of ``racks_per_pod`` racks;
        NVLink domains of ``nvlink_domain`` GPUs inside a node (default: the whole node).

        Example:
          >>> Topology.regular(nodes=1250, nodes_per_rack=32).domains("rack")
          40
        """
        from fsg._src.topology import builders

        return builders.regular(cls, nodes, gpus_per_node, nodes_per_rack, racks_per_pod, nvlink_domain, links)

    @classmethod
    def from_hostnames(cls, hostnames: Sequence[str], *, racks: Mapping[str, object] | int | None = None,
                       pods: Mapping[object, object] | int | None = None,
                       links: Mapping[str, object] | None = None,
                       nvlink: Sequence[object] | None = None) -> Topology:  # fmt: skip
        """A topology from each rank's hostname (ranks of one host form a node).

        Args:
          hostnames: one per rank.
          racks: ``{hostname: rack}``, or a number of nodes per rack (hosts in order of first
            appearance); default: no rack level.
          pods: ``{rack: pod}`` or a number of racks per pod; default: no pod level.
          nvlink: per rank, a label of its NVLink domain inside its host; when some host has
            more than one, the topology gets an ``"nvlink"`` level. Default: none.

        Example:
          >>> Topology.from_hostnames(["a", "a", "b", "b"], racks=1)
          Topology(4 GPUs: node 2 x 2, rack 2 x 2, cluster 1 x 4)
        """
        from fsg._src.topology import builders

        return builders.from_hostnames(cls, hostnames, racks, pods, links, nvlink)

    @classmethod
    def from_dict(cls, description: Mapping[str, object]) -> Topology:
        """A topology from a parsed YAML/JSON description (see ``docs/topology.md``)."""
        from fsg._src.topology import builders

        return builders.from_dict(cls, description)

    @classmethod
    def load(cls, path: str, *, gpus_per_node: int | None = None) -> Topology:
        """A topology from a ``.yaml``/``.yml``/``.json`` description or a Slurm
        ``topology.conf`` (any other suffix; ``gpus_per_node`` then says how many ranks a node runs)."""
        from fsg._src.topology import builders

        return builders.load(cls, path, gpus_per_node)

    @classmethod
    def from_job(cls, *, hostname: str | None = None, rack: object = None, nvlink: object = None,
                 links: Mapping[str, object] | None = None) -> Topology:  # fmt: skip
        """The running job's topology: every rank's hostname, rack (when given) and NVLink
        domain gathered with ``all_gather_object``. Call after ``fsg.distributed.initialize()``;
        every rank must call it.

        Args:
          hostname: this rank's node name; default ``$FSG_HOSTNAME``, else ``socket.gethostname()``
            (set it to simulate several nodes on one machine).
          rack: this rank's rack label; default ``$FSG_RACK`` when set, else no rack level.
          nvlink: this rank's NVLink domain inside its node; default ``$FSG_NVLINK`` when set,
            else discovered from NVML on CUDA (GPUs of a node on one NVSwitch, or joined by
            direct links, share a domain); without NVML nothing is known below the node. An
            ``"nvlink"`` level appears only when some node holds two or more domains.
        """
        from fsg._src.topology import gather

        return gather.from_job(cls, hostname=hostname, rack=rack, nvlink=nvlink, links=links)


__all__ = ["LEVEL_NAMES", "Link", "Topology"]
