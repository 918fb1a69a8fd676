"""Building topologies from descriptions, and the errors bad descriptions raise."""

import json

import pytest

import fsg
import fsg.topology
from fsg._src.errors import TopologyError
from fsg._src.topology.description import Topology
from fsg._src.topology.placement import place
from fsg._src.topology.slurm import expand_hostlist

SLURM = """\
# two racks under one spine
SwitchName=leaf0 Nodes=gpu[000-001]
SwitchName=leaf1 Nodes=gpu[002-003]
SwitchName=spine Switches=leaf[0-1]
"""


def test_a_regular_cluster_with_a_partial_last_rack():
    t = Topology.regular(nodes=1250, nodes_per_rack=32)
    assert t.world_size == 10_000 and t.domains("rack") == 40 and t.domains("node") == 1250
    assert t.level_names == ("node", "rack", "cluster")


def test_yaml_json_and_slurm_files(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "nodes: 4\ngpus_per_node: 2\nnodes_per_rack: 2\nlinks:\n  rack: {bandwidth_GBps: 40, latency_us: 5}\n"
    )
    t = Topology.load(tmp_path / "c.yaml")
    assert repr(t) == "Topology(8 GPUs: node 4 x 2, rack 2 x 4, cluster 1 x 8)"
    assert t.levels[1].link == fsg.topology.Link(40.0, 5.0)
    hosts = {"hosts": [{"name": "a", "gpus": 2, "rack": "r0"}, {"name": "b", "gpus": 2, "rack": "r1"}]}
    (tmp_path / "c.json").write_text(json.dumps(hosts))
    assert Topology.load(tmp_path / "c.json").domains("rack") == 2
    (tmp_path / "topology.conf").write_text(SLURM)
    t = Topology.load(tmp_path / "topology.conf", gpus_per_node=4)
    assert t.world_size == 16 and t.domains("rack") == 2 and t.labels[0][:2] == ["gpu000", "gpu001"]


def test_hostlists():
    assert expand_hostlist("gpu[00-02,07],login", "x") == ["gpu00", "gpu01", "gpu02", "gpu07", "login"]
    with pytest.raises(TopologyError, match="bad range '3-1'"):
        expand_hostlist("n[3-1]", "topology.conf:1")


@pytest.mark.parametrize(
    "description, match",
    [
        ({"nodes": 2, "links": {"leaf": {"bandwidth_GBps": 1, "latency_us": 1}}}, r"links key 'leaf' is 'leaf', which is not a topology level"),
        ({"nodes": 2, "racks": 4}, r"unknown field 'racks'.*nodes_per_rack"),
        ({"nodes": 0}, r"nodes is 0; it must be an int >= 1"),
        ({"nodes": 2, "links": {"node": {"bandwidth_GBps": -1, "latency_us": 1}}}, r"links.node.bandwidth_GBps is -1"),
        ({"nodes": 2, "links": {"rack": {"bandwidth_GBps": 1, "latency_us": 1}}}, r"links names level 'rack', which this topology does not have"),
        ({"hosts": [{"name": "a", "switch": 1}]}, r"hosts\[0\] has unknown field 'switch'"),
        ({"gpus_per_node": 8}, r"lacks 'nodes'"),
        ({"hosts": [{"name": "a", "rack": "r0"}, {"name": "a", "rack": "r1"}]}, r"hosts\[1\] puts host 'a' in rack 'r1', but an earlier entry put it in rack 'r0'"),
        ({"hosts": [{"name": "a", "rack": "r0", "pod": "p0"}, {"name": "b", "rack": "r0", "pod": "p1"}]}, r"hosts\[1\] puts rack 'r0' in pod 'p1'.*in pod 'p0'"),
    ],
)  # fmt: skip
def test_bad_descriptions_name_the_field(description, match):
    with pytest.raises(TopologyError, match=match):
        Topology.from_dict(description)


def test_bad_files_name_the_file_and_line(tmp_path):
    (tmp_path / "t.yaml").write_text("nodes: 2\nlevels: [gpu]\n")
    with pytest.raises(TopologyError, match=r"t.yaml: the topology description has unknown field 'levels'"):
        Topology.load(tmp_path / "t.yaml")
    (tmp_path / "topology.conf").write_text("SwitchName=s0 Nodez=a[1-2]\n")
    with pytest.raises(TopologyError, match=r"topology.conf:1: cannot read .*'Nodez'"):
        Topology.load(tmp_path / "topology.conf")
    with pytest.raises(TopologyError, match="does not exist"):
        Topology.load(tmp_path / "missing.yaml")


def test_levels_must_nest_and_be_known():
    with pytest.raises(TopologyError, match=r"levels\[0\] is 'gpu', which is not a topology level"):
        Topology(["gpu", "cluster"], [["a", "all"]])
    with pytest.raises(TopologyError, match="node 'a' lies in two rack domains"):
        Topology.from_hostnames(["a", "a"], racks={"a": "r0"}) and Topology(
            ["node", "rack", "cluster"], [["a", "r0", "all"], ["a", "r1", "all"]]
        )
    with pytest.raises(TopologyError, match="outermost level 'rack' has 2 domains"):
        Topology(["node", "rack"], [["a", "r0"], ["b", "r1"]])


@pytest.mark.parametrize(
    "axes, kwargs, match",
    [
        ({"dp": 4, "tp": 8}, {}, r"has 32 devices but the cluster has 16 GPUs .*shrink an axis"),
        ({"dp": 2, "tp": 4}, {}, r"has 8 devices but the cluster has 16 GPUs; a mesh covers the whole job"),
        ({"dp": 1, "tp": 16}, {"within": {"tp": "node"}}, r"axis 'tp' of size 16 cannot be placed within one node: .*hold 8-8 GPUs"),
        ({"dp": 2, "tp": 8}, {"within": {"tp": "switch"}}, r"within\['tp'\] is 'switch', which is not a topology level"),
        ({"dp": 2, "tp": 8}, {"traffic": {"dp": 1}}, r"traffic lacks axis 'tp'"),
        ({"dp": 2, "tp": 0}, {}, r"axes\['tp'\] = 0"),
    ],
)  # fmt: skip
def test_meshes_that_cannot_be_placed(axes, kwargs, match):
    t = Topology.regular(nodes=2, gpus_per_node=8)
    with pytest.raises(TopologyError, match=match):
        place(axes, t, **kwargs)


def test_from_topology_outside_a_job_is_a_mesh_of_one():
    assert repr(fsg.Mesh.from_topology({"dp": 1}, Topology.from_hostnames(["a"]))) == "Mesh({'dp': 1})"
    with pytest.raises(fsg.FsgError, match="needs a process group"):
        Topology.from_job()
    with pytest.raises(fsg.MeshError, match="hold each rank 0..0 once"):
        fsg.Mesh({"dp": 1}, ranks=[3])
