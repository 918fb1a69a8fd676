"""The cost model, plan() and the CLI."""

import json
from pathlib import Path

import pytest

from fsg._src.errors import TopologyError
from fsg._src.topology import cli
from fsg._src.topology.cost import CostModel, bus_factor, fit
from fsg._src.topology.description import Topology
from fsg._src.topology.levels import Link
from fsg._src.topology.plan import factorizations, plan
from fsg._src.topology.workload import PRESETS


def test_the_model_is_floor_plus_bytes_over_bus_bandwidth():
    model = CostModel()
    link = Link(335.0, 1.5)
    small, big = model.time("all_gather_into_tensor", 2, 4096, link), model.time("all_gather", 2, 1 << 30, link)
    assert 33e-6 < small < 40e-6  # the floor
    assert big == pytest.approx(33e-6 + 1.5e-6 + 0.5 * (1 << 30) / 335e9)
    assert model.time("all_reduce", 1, 1 << 30, link) == 0.0
    slow = model.time("all_gather", 2, 1 << 30, Link(45.0, 6.0))
    assert slow > 7 * big  # the network link caps the bandwidth


def test_a_calibration_round_trips_through_fit_and_load(tmp_path):
    samples = [
        {"kind": "all_reduce", "bytes": s, "time_us": 20.0 + bus_factor("all_reduce", 2) * s / 300e9 * 1e6}
        for s in (4096, 1 << 20, 64 << 20, 1 << 30)
    ]
    table = fit(samples, 2)
    assert table["all_reduce"]["busbw_GBps"] == pytest.approx(300, rel=0.01)
    (tmp_path / "cal.json").write_text(json.dumps({"fit": table}))
    model = CostModel.load(tmp_path / "cal.json")
    t = model.time("all_reduce", 2, 1 << 30, Link(335.0, 0.0))
    assert t == pytest.approx(samples[-1]["time_us"] * 1e-6, rel=0.01)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TopologyError, match="has no 'fit' table"):
        CostModel.load(tmp_path / "bad.json")


def test_plan_puts_tensor_parallel_on_nvlink_and_ranks_meshes():
    topo = Topology.regular(nodes=8, gpus_per_node=8, nodes_per_rack=4)
    result = plan(PRESETS["gpt-1b"], None, topo)
    best = result.best
    assert {c.axis: c.level for c in best.per_axis if c.size > 1}.get("tp", "node") == "node"
    assert [round(c.step_s, 9) for c in result.ranked] == sorted(round(c.step_s, 9) for c in result.ranked)
    assert "cross-rack" in result.as_text() and "model predictions" in result.as_text()
    assert best.describe() in result.reason
    assert all(c.cross_rack_bytes <= c.level_bytes["cluster"] + 1e-6 for c in result.ranked)


def test_plan_of_lowered_collective_rows_and_its_errors():
    topo = Topology.from_hostnames(["a", "b", "a", "b"])
    rows = [("all_reduce", "tp", 1 << 20, 4), ("all_gather_into_tensor", "dp", 1 << 18, 2)]
    result = plan(rows, {"dp": 2, "tp": 2}, topo)
    assert result.best.strategy == "packed"
    assert {c.axis: c.level for c in result.best.per_axis} == {"dp": "cluster", "tp": "node"}
    with pytest.raises(TopologyError, match="axis 'ep', which mesh"):
        plan([("all_reduce", "ep", 1, 1)], {"dp": 2, "tp": 2}, topo)
    with pytest.raises(TopologyError, match="needs a GPTConfig"):
        plan(rows, None, topo)


def test_factorizations_cover_the_world():
    assert all(c["dp"] * c["fsdp"] * c["tp"] == 12 for c in factorizations(12))
    assert len(factorizations(12)) == 18


def test_cli_prints_a_plan_and_refuses_bad_input(capsys, tmp_path):
    assert cli.main(["plan", "--nodes", "4", "--nodes-per-rack", "2", "--model", "gpt-1b", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "ranking (top 3" in out
    (tmp_path / "t.yaml").write_text("nodes: 2\nlinks: {leaf: {bandwidth_GBps: 1, latency_us: 1}}\n")
    assert cli.main(["plan", "--topology", str(tmp_path / "t.yaml")]) == 2
    assert "'leaf', which is not a topology level" in capsys.readouterr().err
    assert cli.main(["plan", "--nodes", "2", "--model", "gpt-9t"]) == 2


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_a_pipeline_axis_divides_state_and_layers_and_costs_its_bubble(pp):
    """pp holds 1/pp of the state and layers; 1F1B's bubble (pp-1)/(m+pp-1) stretches compute;
    each microbatch's activations cross a boundary each way (send_recv on pp)."""
    cfg = PRESETS["gpt-70b"]
    flat, piped = {"dp": 25, "fsdp": 5, "tp": 8}, {"dp": 25, "fsdp": 5, "tp": 8, "pp": pp}
    m = cfg.microbatches(piped)
    assert m == cfg.global_batch // 125 and cfg.bubble(piped) == pytest.approx((pp - 1) / (m + pp - 1))
    assert cfg.memory_per_gpu(piped) < cfg.memory_per_gpu(flat)
    assert cfg.compute_s(1000 * pp, piped) == pytest.approx(cfg.compute_s(1000 * pp) / (1 - cfg.bubble(piped)))
    rows = {(kind, axis): (nbytes, count) for kind, axis, nbytes, count in cfg.collectives(piped)}
    act = cfg.tokens / 125 * cfg.d_model * 2
    assert rows[("send_recv", "pp")] == (int(2 * act / 8), 2 * m)
    flat_rows = {(k, a): n for k, a, n, _ in cfg.collectives(flat)}
    assert rows[("all_reduce", "dp")][0] == pytest.approx(flat_rows[("all_reduce", "dp")] / pp, rel=1e-6)


def test_a_pipeline_axis_is_refused_where_it_cannot_run():
    cfg = PRESETS["gpt-70b"]
    assert "do not divide into pp=3" in cfg.check_mesh({"dp": 5, "tp": 8, "pp": 3})
    assert "fewer than pp=8" in cfg._replace(global_batch=40).check_mesh({"dp": 10, "tp": 8, "pp": 8})


def test_plan_places_the_pipeline_axis_across_racks_and_models_it():
    """On a cluster of racks, the packed placement puts tp in the node and pp, the least
    traffic, across racks; plan() ranks pp meshes among the candidates."""
    topo = Topology.regular(nodes=16, gpus_per_node=8, nodes_per_rack=4)
    cfg = PRESETS["gpt-7b"]._replace(global_batch=256)
    result = plan(cfg, [{"dp": 4, "tp": 8, "pp": 4}], topo)
    levels = {c.axis: c.level for c in result.best.per_axis}
    assert levels["tp"] == "node" and levels["pp"] == "cluster" and result.best.strategy == "packed"
    everything = plan(cfg, None, topo)
    assert any("pp" in c.axes for c in everything.ranked)


@pytest.mark.slow
def test_the_documented_10000_gpu_study_is_what_the_command_prints(capsys):
    """docs/topology.md's study row for the 175B-class model, from its command."""
    assert cli.main(["plan", "--nodes", "1250", "--nodes-per-rack", "32", "--model", "gpt-175b", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "mesh dp=125 x fsdp=5 x tp=2 x pp=8 (packed)" in out and "step 8,039.3 ms" in out
    doc = (Path(__file__).parents[2] / "docs" / "topology.md").read_text()
    assert "| dp=125 × fsdp=5 × tp=2 × pp=8 |" in doc and "| 8.04 s |" in doc
