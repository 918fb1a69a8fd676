"""Properties of ``Mesh.from_topology``'s placement over random described clusters."""

import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fsg._src.topology import placement, traffic
from fsg._src.topology.placement import place
from tests.topology.strategies import axes_strategy, topology_strategy


@st.composite
def case_strategy(draw):
    topo = draw(topology_strategy())
    gpus = int(np.bincount(topo.ids[:, topo.level_index("node")]).max())
    return topo, draw(axes_strategy(topo.world_size, gpus))


@given(case_strategy())
def test_the_permutation_is_a_bijection_of_the_mesh_shape(case):
    topo, axes = case
    p = place(axes, topo)
    assert p.ranks.shape == tuple(axes.values())
    assert sorted(p.ranks.ravel().tolist()) == list(range(topo.world_size))


@given(case_strategy())
def test_a_tensor_parallel_group_stays_in_a_node_when_it_fits(case):
    topo, axes = case
    node = topo.level_index("node")
    sizes = np.bincount(topo.ids[:, node])
    p = place(axes, topo)
    if (sizes % axes["tp"] == 0).all():  # every node holds whole tp groups
        assert traffic.span_level(topo, p.ranks, list(axes).index("tp")) <= node


@given(case_strategy(), st.dictionaries(st.sampled_from(["dp", "fsdp", "tp"]), st.integers(0, 1000)))
def test_cross_rack_traffic_never_exceeds_row_major(case, given_traffic):
    topo, axes = case
    weights = {a: float(given_traffic.get(a, 1 + i)) for i, a in enumerate(axes)}
    p = place(axes, topo, traffic=weights)
    naive = placement.row_major(axes)
    assert placement.cross_rack(topo, p.ranks, axes, weights) <= placement.cross_rack(topo, naive, axes, weights)


@given(case_strategy())
def test_the_placement_is_deterministic(case):
    topo, axes = case
    assert np.array_equal(place(axes, topo).ranks, place(dict(axes), topo).ranks)


def test_the_placement_is_the_same_in_another_process():
    code = (
        "from fsg._src.topology.description import Topology\n"
        "from fsg._src.topology.placement import place\n"
        "t = Topology.regular(nodes=10, gpus_per_node=8, nodes_per_rack=3)\n"
        "print(place({'dp': 4, 'fsdp': 5, 'tp': 4}, t).ranks.ravel().tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    from fsg._src.topology.description import Topology

    t = Topology.regular(nodes=10, gpus_per_node=8, nodes_per_rack=3)
    assert out.strip() == str(place({"dp": 4, "fsdp": 5, "tp": 4}, t).ranks.ravel().tolist())


def test_tp_fills_nodes_fsdp_racks_dp_crosses_them():
    from fsg._src.topology.description import Topology

    t = Topology.regular(nodes=8, gpus_per_node=8, nodes_per_rack=4)
    axes = {"dp": 2, "fsdp": 4, "tp": 8}
    p = place(axes, t)
    levels = [t.level_names[traffic.span_level(t, p.ranks, i)] for i in range(3)]
    assert levels == ["cluster", "rack", "node"]


def test_hostnames_out_of_rank_order_are_grouped_by_node():
    from fsg._src.topology.description import Topology

    t = Topology.from_hostnames(["a", "b", "a", "b"])  # torchrun's ranks need not follow nodes
    p = place({"dp": 2, "tp": 2}, t)
    assert p.ranks.tolist() == [[0, 2], [1, 3]]
    assert placement.row_major({"dp": 2, "tp": 2}).tolist() == [[0, 1], [2, 3]]


def test_groups_that_do_not_tile_racks_cross_fewer_rack_links_than_row_major():
    from fsg._src.topology.description import Topology

    t = Topology.regular(nodes=12, gpus_per_node=8, nodes_per_rack=4)  # 3 racks of 4 nodes
    axes = {"dp": 4, "fsdp": 3, "tp": 8}  # FSDP groups of 3 nodes: one per rack, the rest left over
    p = place(axes, t)
    weights = dict(placement.DEFAULT_TRAFFIC)
    packed, naive = (placement.cross_rack(t, r, axes, weights) for r in (p.ranks, placement.row_major(axes)))
    assert p.strategy == "packed" and packed < naive
    spans = t.span_level(traffic.groups(p.ranks, 1))
    assert (spans <= t.level_index("rack")).sum() == 3 * 8  # one FSDP block (x 8 tp ranks) inside each rack
