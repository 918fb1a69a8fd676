"""NVLink domains: NVML's answers per GPU grouped into domains, and the topology level they make."""

import pytest

from fsg._src.errors import TopologyError
from fsg._src.topology import nvml
from fsg._src.topology.description import Topology
from fsg._src.topology.nvml import Links
from fsg._src.topology.placement import place

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


def bus(i: int) -> str:
    return f"00000000:{i:02x}:00.0"


@pytest.mark.parametrize(
    "given, normalized",
    [("00000000:19:00.0", "00000000:19:00.0"), ("0000:1B:00.0", "00000000:1b:00.0"), ("19:00.0", "00000000:19:00.0")],
)
def test_bus_ids_are_normalized(given, normalized):
    assert nvml.normalize_bus_id(given) == normalized


def test_a_bad_bus_id_is_a_clear_error():
    with pytest.raises(ValueError, match="not a PCI bus id"):
        nvml.normalize_bus_id("GPU-0")


@st.composite
def hosts_with_domains(draw):
    """Ranks on 1-3 hosts; each host's GPUs split into domains, each domain an NVSwitch or a
    chain/ring of direct links (or one GPU without NVLink); some ranks share a GPU."""
    hostnames, records, truth = [], [], []
    for h in range(draw(st.integers(1, 3))):
        sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
        gpu = 0
        for d, size in enumerate(sizes):
            ids = [bus(gpu + i) for i in range(size)]
            gpu += size
            switch = size > 1 and draw(st.booleans())
            ring = draw(st.booleans())
            for i, me in enumerate(ids):
                switches = (bus(0x80 + d),) if switch else ()
                if switch:
                    peers = ()
                else:  # a chain: i - 1 and i + 1; a ring closes it
                    near = {i - 1, i + 1} | ({0, size - 1} if ring and i in (0, size - 1) else set())
                    peers = tuple(ids[j] for j in sorted(near) if 0 <= j < size and j != i)
                for _ in range(draw(st.integers(1, 2))):  # a GPU may hold two ranks
                    hostnames.append(f"h{h}")
                    records.append(Links(me, len(peers) + 4 * switch, switches, peers))
                    truth.append((h, d))
    order = draw(st.permutations(range(len(hostnames))))  # ranks in any order
    return [hostnames[i] for i in order], [records[i] for i in order], [truth[i] for i in order]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(hosts_with_domains())
def test_ranks_share_a_domain_exactly_when_nvlink_joins_their_gpus(case):
    hostnames, records, truth = case
    labels = nvml.nvlink_domains(hostnames, records)
    for i in range(len(labels)):
        for j in range(len(labels)):
            same = hostnames[i] == hostnames[j] and labels[i] == labels[j]
            assert same == (truth[i] == truth[j]), (i, j, labels, truth)
    topo = Topology.from_hostnames(hostnames, nvlink=labels)
    split = any(len({d for (h, d) in truth if h == host}) > 1 for host in {h for h, _ in truth})
    assert ("nvlink" in topo.level_names) == split


def test_a_rank_without_an_answer_means_nothing_is_known_below_the_node():
    assert nvml.nvlink_domains(["a", "a"], [Links(bus(0), 0, (), ()), None]) is None


def test_tp_stays_inside_an_nvlink_domain():
    # two hosts of 4 GPUs, each two NVLink pairs over PCIe: tp=2 must pair NVLink peers
    hostnames = ["a"] * 4 + ["b"] * 4
    labels = ["nvl0", "nvl1", "nvl0", "nvl1"] * 2  # the pairs interleave in rank order
    topo = Topology.from_hostnames(hostnames, nvlink=labels)
    assert topo.level_names == ("nvlink", "node", "cluster")
    ranks = place({"dp": 4, "tp": 2}, topo).ranks  # what Mesh.from_topology builds on
    for pair in ranks.reshape(4, 2).tolist():
        assert {hostnames[r] for r in pair} == {hostnames[pair[0]]} and labels[pair[0]] == labels[pair[1]], pair


def test_bad_nvlink_labels_are_clear_errors():
    with pytest.raises(TopologyError, match="nvlink gives 1 labels for 2 ranks"):
        Topology.from_hostnames(["a", "a"], nvlink=["x"])


def test_without_nvml_nothing_is_discovered():
    assert nvml.links_of(None) is None
    if nvml._library() is None:  # the CPU machines: no libnvidia-ml
        assert nvml.links_of(bus(0)) is None


def test_the_node_link_between_nvlink_domains_defaults_to_pcie_not_nvlink():
    split = Topology.from_hostnames(["a"] * 4, nvlink=["nvl0", "nvl0", "nvl1", "nvl1"])
    links = {level.name: level.link for level in split.levels}
    assert links["node"].bandwidth_GBps < links["nvlink"].bandwidth_GBps / 10
    whole = Topology.from_hostnames(["a"] * 4, nvlink=["nvl0"] * 4)  # one domain: the node is NVLink
    assert whole.level_names == ("node", "cluster") and whole.levels[0].link.bandwidth_GBps == 335.0
    given = Topology.from_hostnames(["a"] * 4, nvlink=["x", "x", "y", "y"], links={"node": {"bandwidth_GBps": 50, "latency_us": 3}})
    assert given.levels[1].link.bandwidth_GBps == 50
