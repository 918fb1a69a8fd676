"""A real two-node launch on one machine: two ``torchrun`` agents (``--nnodes 2``, c10d
rendezvous over localhost, 2 gloo ranks each, a hostname per node) build the mesh from the
gathered topology, and the step on it equals the unsharded step (``two_nodes.py``)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchrun
SCRIPT = Path(__file__).with_name("two_nodes.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_place_tp_inside_a_node_and_match_the_unsharded_step(tmp_path):
    port = _free_port()
    agents = []
    for node in ("node-a", "node-b"):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=fsg-two-nodes",
            "--max-restarts=0", str(SCRIPT),
        ]  # fmt: skip
        env = {**os.environ, "FSG_HOSTNAME": node, "FSG_TEST_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [a.communicate(timeout=600)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    hosts = seen[0]["hosts"]
    assert sorted(hosts) == ["node-a", "node-a", "node-b", "node-b"]  # torchrun numbered each node's ranks
    for rank in seen:
        assert rank["topology"] == "Topology(4 GPUs: node 2 x 2, cluster 1 x 4)"
        assert len({hosts[r] for r in rank["tp_group"]}) == 1, (rank["tp_group"], hosts)  # tp inside a node
        assert rank["mesh"] == seen[0]["mesh"]  # every rank built the same mesh
    # tp-outermost row-major placement would have paired ranks 0 and 2, across the nodes
    assert seen[0]["mesh"] != [[0, 1], [2, 3]]
