"""The running job's topology, gathered from every rank (hostname, rack and NVLink domain) by
``all_gather_object``."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from fsg._src.errors import TopologyError
from fsg._src.topology import nvml


def _all_or_none(values: list, what: str, how: str) -> bool:
    given = [v for v in values if v is not None]
    if given and len(given) != len(values):
        raise TopologyError(f"{len(given)} of {len(values)} ranks gave {what} ({how}); give every rank one, or none")
    return bool(given)


def from_job(cls, *, hostname, rack, nvlink, links):
    if not (dist.is_available() and dist.is_initialized()):
        raise TopologyError(
            "Topology.from_job() gathers every rank's hostname and needs a process group; call "
            "fsg.distributed.initialize() first (under torchrun), or describe the cluster with Topology.load"
        )
    host = hostname or os.environ.get("FSG_HOSTNAME") or socket.gethostname()
    rack = rack if rack is not None else os.environ.get("FSG_RACK")
    nvlink = nvlink if nvlink is not None else os.environ.get("FSG_NVLINK")
    found = nvml.links_of(nvml.cuda_bus_id()) if nvlink is None else None
    mine = (str(host), None if rack is None else str(rack), None if nvlink is None else str(nvlink), found)
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    hosts = [h for h, _, _, _ in table]
    racks = (
        {h: r for h, r, _, _ in table}
        if _all_or_none([r for _, r, _, _ in table], "a rack", "FSG_RACK / rack=")
        else None
    )
    if _all_or_none([n for _, _, n, _ in table], "an NVLink domain", "FSG_NVLINK / nvlink="):
        domains = [n for _, _, n, _ in table]
    else:
        domains = nvml.nvlink_domains(hosts, [f for _, _, _, f in table])
    return cls.from_hostnames(hosts, racks=racks, nvlink=domains, links=links)
