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
import fsg.sharding  # noqa: E402
import fsg.testing  # noqa: E402
from tests.helpers import mlp, mse_loss_fn, regression_batch  # noqa: E402


def main() -> None:
    info = fsg.distributed.initialize(backend="gloo")
    topo = fsg.Topology.from_job()
    mesh = fsg.Mesh.from_topology({"tp": 2, "dp": 2}, topo, device_type="cpu")
    hosts: list = [None] * info.world_size
    dist.all_gather_object(hosts, os.environ["FSG_HOSTNAME"])
    tp_group = dist.get_process_group_ranks(mesh.device_mesh.get_group("tp"))
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    rules = fsg.sharding.rules([(r"0\.weight", fsg.P("tp", None)), (r"2\.weight", fsg.P(None, "tp"))])
    fsg.testing.assert_sharded_matches_unsharded(
        mse_loss_fn(model), fsg.params(model), [regression_batch(n=16, seed=i) for i in range(3)], mesh,
        optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), param_sharding=rules, batch_sharding=fsg.P("dp"),
    )  # fmt: skip
    seen = {"rank": info.rank, "hosts": hosts, "topology": repr(topo), "tp_group": tp_group,
            "mesh": mesh.device_mesh.mesh.tolist()}  # fmt: skip
    Path(os.environ["FSG_TEST_OUT"], f"rank{info.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
