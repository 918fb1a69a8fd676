"""What ``torchrun`` runs on each of two simulated nodes (``tests/topology/test_torchrun_nodes.py``).

Each node's agent sets ``FSG_HOSTNAME``; every rank gathers the job's topology, builds a mesh
whose axes are named tp-outermost (so row-major placement would put each tp pair across the
two nodes), checks that each tp group stays inside one node, checks that the step on the mesh
equals the unsharded step, and writes what it saw to ``$FSG_TEST_OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

import fsg  # noqa: E402
from tests.topology.workers import check_tp_dp_step  # noqa: E402


def main() -> None:
    info = fsg.distributed.initialize(backend="gloo")
    topo = fsg.Topology.from_job()
    mesh = fsg.Mesh.from_topology({"tp": 2, "dp": 2}, topo, device_type="cpu")
    hosts: list = [None] * info.world_size
    dist.all_gather_object(hosts, os.environ["FSG_HOSTNAME"])
    tp_group = dist.get_process_group_ranks(mesh.device_mesh.get_group("tp"))
    check_tp_dp_step(mesh)
    seen = {"rank": info.rank, "hosts": hosts, "topology": repr(topo), "tp_group": tp_group,
            "mesh": mesh.device_mesh.mesh.tolist()}  # fmt: skip
    Path(os.environ["FSG_TEST_OUT"], f"rank{info.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
