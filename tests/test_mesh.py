"""Mesh, P and sharding rules in one process (no process group needed)."""

import pytest
from hypothesis import given

import fsg
import fsg.testing


def test_p_entries_and_repr():
    assert fsg.P("dp", None) == ("dp", None)
    assert repr(fsg.P(("dp", "tp"), None)) == "P(('dp', 'tp'), None)"
    assert fsg.P(("dp", "tp"), None, "x").axes() == ["dp", "tp", "x"]
    with pytest.raises(fsg.MeshError, match="axis names, tuples of axis names or None"):
        fsg.P(3)


def test_mesh_of_size_one_needs_no_process_group():
    mesh = fsg.Mesh({"dp": 1, "tp": 1})
    assert mesh.size == 1 and mesh.axis_names == ("dp", "tp")
    with pytest.raises(fsg.MeshError, match="spans one device"):
        mesh.device_mesh  # noqa: B018


def test_mesh_larger_than_the_world_is_refused_with_the_fix():
    with pytest.raises(fsg.MeshError, match=r"has 4 devices but the world size is 1; call fsg.distributed.initialize"):
        fsg.Mesh({"dp": 2, "tp": 2})


@pytest.mark.parametrize(
    "spec, shape, match",
    [
        (fsg.P("mp"), (4,), r"names axis 'mp', which Mesh\(\{'dp': 1, 'tp': 1\}\) does not have"),
        (fsg.P("dp", "dp"), (4, 4), "uses axis 'dp' twice"),
        (fsg.P(("tp", "dp")), (4,), r"out of mesh order; write them as \('dp', 'tp'\)"),
        (fsg.P(None, None, "dp"), (4, 4), "has 3 entries but params\\['w'\\] has 2 dims"),
    ],
)
def test_spec_validation_names_the_leaf_and_rule(spec, shape, match):
    with pytest.raises(fsg.MeshError, match=match):
        fsg.Mesh({"dp": 1, "tp": 1}).validate(spec, shape, "params['w']")


@pytest.mark.parametrize(
    "spec, match",
    [
        (fsg.P("mp", None), r"P\('mp', None\) for params\['0.weight'\] names axis 'mp'"),
        (fsg.P(None, None, "dp"), r"has 3 entries but params\['0.weight'\] has 2 dims"),
        (fsg.P("dp", "dp"), r"P\('dp', 'dp'\) for params\['0.weight'\] uses axis 'dp' twice"),
    ],
)
def test_a_step_on_a_mesh_of_size_one_checks_the_specs_it_would_use_on_a_cluster(spec, match):
    """The mistake surfaces on the laptop, at init, not on the cluster."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    step = fsg.compile_step(
        lambda p, b: fsg.apply(model, p, b["x"]).sum(), fsg.Mesh({"dp": 1}), optimizer=fsg.optim.sgd(0.1),
        param_sharding=fsg.sharding.rules([(r"0\.weight", spec)]), backend="eager",
    )  # fmt: skip
    with pytest.raises(fsg.MeshError, match=match):
        step.init(fsg.params(model))


def test_a_batch_spec_on_a_mesh_of_size_one_is_checked_at_the_first_step():
    import torch

    model = torch.nn.Linear(4, 2)
    step = fsg.compile_step(
        lambda p, b: fsg.apply(model, p, b["x"]).sum(), fsg.Mesh({"dp": 1}), optimizer=fsg.optim.sgd(0.1),
        batch_sharding=fsg.P("data"), backend="eager",
    )  # fmt: skip
    with pytest.raises(fsg.MeshError, match=r"P\('data'\) for batch\['x'\] names axis 'data'"):
        step(step.init(fsg.params(model)), {"x": torch.ones(2, 4)})


def test_placements_follow_mesh_axes():
    from torch.distributed.tensor import Replicate, Shard

    mesh = fsg.Mesh({"dp": 1, "tp": 1})
    assert mesh.placements(fsg.P("tp", None)) == [Replicate(), Shard(0)]
    assert mesh.placements(fsg.P(None, ("dp", "tp"))) == [Shard(1), Shard(1)]
    assert mesh.placements(fsg.P()) == [Replicate(), Replicate()]


def test_rules_first_match_wins_and_presets():
    mesh = fsg.Mesh({"dp": 1, "tp": 1})
    r = fsg.sharding.rules([(r".*\.weight", fsg.P("tp")), (r"head\.weight", fsg.P())], default=fsg.P("dp"))
    assert r.spec_for("head.weight", (4, 4), mesh) == fsg.P("tp")
    assert r.spec_for("head.bias", (4,), mesh) == fsg.P("dp")
    tp = fsg.sharding.tensor_parallel()
    assert tp.spec_for("blocks.3.attn.qkv.weight", (48, 16), mesh) == fsg.P("tp", None)
    assert tp.spec_for("blocks.3.attn.qkv.bias", (48,), mesh) == fsg.P("tp")
    assert tp.spec_for("blocks.3.attn.proj.weight", (16, 16), mesh) == fsg.P(None, "tp")
    assert tp.spec_for("blocks.3.attn.proj.bias", (16,), mesh) == fsg.P()
    assert tp.spec_for("wte.weight", (32, 16), mesh) == fsg.P()
    assert fsg.sharding.fsdp().spec_for("x", (3, 8), mesh) == fsg.P("dp")
    combined = fsg.sharding.fsdp_tensor_parallel()
    assert combined.spec_for("blocks.0.fc_proj.weight", (16, 64), mesh) == fsg.P("dp", "tp")


@given(fsg.testing.mesh_strategy(4))
def test_mesh_strategy_sizes_multiply_to_the_world(axes):
    import math

    assert math.prod(axes.values()) == 4 and 1 <= len(axes) <= 2


@given(fsg.testing.spec_strategy((12, 6, 4), {"dp": 2, "tp": 3}))
def test_spec_strategy_draws_only_valid_specs(spec):
    sizes = {"dp": 2, "tp": 3}
    seen = spec.axes()
    assert len(seen) == len(set(seen))
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        ways = 1
        for n in names:
            ways *= sizes.get(n, 1) if n else 1
        assert (12, 6, 4)[dim] % ways == 0
