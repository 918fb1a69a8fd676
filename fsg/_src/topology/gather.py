"""The running job's topology, gathered from every rank (hostname and rack) by ``all_gather_object``."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from fsg._src.errors import TopologyError


def from_job(cls, *, hostname, rack, links):
    if not (dist.is_available() and dist.is_initialized()):
        raise TopologyError(
            "Topology.from_job() gathers every rank's hostname and needs a process group; call "
            "fsg.distributed.initialize() first (under torchrun), or describe the cluster with Topology.load"
        )
    host = hostname or os.environ.get("FSG_HOSTNAME") or socket.gethostname()
    rack = rack if rack is not None else os.environ.get("FSG_RACK")
    mine = (str(host), None if rack is None else str(rack))
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    with_rack = [r for _, r in table if r is not None]
    if with_rack and len(with_rack) != len(table):
        raise TopologyError(
            f"{len(with_rack)} of {len(table)} ranks gave a rack (FSG_RACK / rack=); give every rank one, or none"
        )
    racks = {h: r for h, r in table} if with_rack else None
    return cls.from_hostnames([h for h, _ in table], racks=racks, links=links)
