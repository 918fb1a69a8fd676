"""What the multi-rank topology test runs on every rank (importable by name)."""

from __future__ import annotations

import torch.distributed as dist

import fsg
import fsg.sharding
import fsg.testing
from fsg._src.topology.description import Topology
from tests.helpers import mlp, mse_loss_fn, regression_batch


def check_mesh_from_gathered_topology() -> list:
    """Two simulated nodes whose ranks interleave (rank r on node r % 2, as torchrun may number
    them): the tp pairs must be {0, 2} and {1, 3}, and the step must equal the unsharded one."""
    rank = dist.get_rank()
    topo = Topology.from_job(hostname=f"node{rank % 2}")
    mesh = fsg.Mesh.from_topology({"dp": 2, "tp": 2}, topo, device_type="cpu")
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, f"node{rank % 2}")
    tp_group = dist.get_process_group_ranks(mesh.device_mesh.get_group("tp"))
    assert len({hosts[r] for r in tp_group}) == 1, f"tp group {tp_group} spans nodes {hosts}"
    check_tp_dp_step(mesh)
    return mesh.device_mesh.mesh.tolist()


def check_tp_dp_step(mesh: fsg.Mesh) -> None:
    """An MLP's step on a mesh with tp and dp axes equals the unsharded step."""
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    rules = fsg.sharding.rules([(r"0\.weight", fsg.P("tp", None)), (r"2\.weight", fsg.P(None, "tp"))])
    fsg.testing.assert_sharded_matches_unsharded(
        mse_loss_fn(model), fsg.params(model), [regression_batch(n=16, seed=i) for i in range(3)], mesh,
        optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), param_sharding=rules, batch_sharding=fsg.P("dp"),
    )  # fmt: skip
