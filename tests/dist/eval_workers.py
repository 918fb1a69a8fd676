"""Rank functions for tests/dist/test_eval.py (spawn-importable)."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fsg
import fsg.testing
from fsg._src import tree
from tests.dist.workers import preset_rules

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import resnet  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)
    )


def _metrics(model):
    def metrics(params, batch, buffers):
        logits = fsg.apply(model, params, batch["x"], buffers=buffers)
        return {"loss": F.cross_entropy(logits, batch["y"]), "logits": logits,
                "accuracy": (logits.argmax(-1) == batch["y"]).float().mean()}  # fmt: skip

    return metrics


def _batch(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(*shape, generator=g) * 2 + 0.5, "y": torch.randint(0, 3, (shape[0],), generator=g)}


def _sharded_and_unsharded(model, preset, shape, steps=2):
    """Train ``steps`` sharded steps (BatchNorm statistics move), then evaluate the state on
    the mesh and, gathered, on one device; returns (sharded metrics, unsharded metrics, the
    evaluation step, the state)."""
    mesh = fsg.testing.mesh({"dp": 2})
    rules = preset_rules(preset)
    step = fsg.compile_step(
        resnet.loss_fn(model), mesh, optimizer=fsg.optim.adamw(1e-2), param_sharding=rules, backend="eager"
    )
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    for i in range(steps):
        state, _ = step(state, _batch(shape, i))
    whole = tree.tree_map(lambda t: t.full_tensor(), state)
    ev = fsg.compile_eval(_metrics(model), mesh, param_sharding=rules, backend="eager")
    held_out = _batch(shape, 100)
    return ev(state, held_out), fsg.compile_eval(_metrics(model), backend="eager")(whole, held_out), ev, state


def check_eval_matches_unsharded(preset: str) -> None:
    """An MLP with BatchNorm and dropout, and a small ResNet-18, evaluated on a dp=2 mesh (batch
    sharded; params replicated or FSDP) equal the unsharded evaluation of the unsharded state."""
    for model, shape in ((_mlp(), (16, 4)), (resnet.make_model(width=4), (8, 3, 16, 16))):
        if shape[1] == 3:  # the ResNet's classes
            model.fc = torch.nn.Linear(model.fc.in_features, 3)
        got, want, ev, state = _sharded_and_unsharded(model, preset, shape)
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-4, atol=1e-5, msg=f"{type(model).__name__} {name}"
            )
        assert got["logits"].shape == (shape[0], 3)  # whole on every rank
        before = [t.to_local().clone() for t in state.buffers.values()]
        ev(state, _batch(shape, 101))
        assert all(torch.equal(a, b.to_local()) for a, b in zip(before, state.buffers.values()))
        assert ev.num_compiles == 1


def check_eval_refuses_other_param_sharding() -> None:
    model = _mlp()
    mesh = fsg.testing.mesh({"dp": 2})
    step = fsg.compile_step(resnet.loss_fn(model), mesh, optimizer=fsg.optim.sgd(0.1), backend="eager")
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    ev = fsg.compile_eval(_metrics(model), mesh, param_sharding=fsg.sharding.fsdp("dp"), backend="eager")
    try:
        ev(state, _batch((16, 4), 0))
    except fsg.MeshError as exc:
        assert "state.params['0.bias'] is placed (Replicate(),), but param_sharding gives it (Shard(dim=0),)" in str(
            exc
        ), exc
    else:
        raise AssertionError("a state placed by other rules was evaluated")
