"""Rank functions for tests/dist/test_convolution.py (spawn-importable)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import fsg
import fsg.testing
from fsg._src.sharding import convolution, raw_collectives
from tests.dist.workers import preset_rules

_aten = torch.ops.aten


def _net(width: int = 4, classes: int = 3) -> nn.Module:
    """ResNet's stem and block layout in small: a stride-2 conv, then padded stride-1 convs
    after BatchNorms (whose outputs DTensor shards on channels), a biased last conv."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, 1, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes),
    )  # fmt: skip


def _loss(model: nn.Module):
    def loss(params, batch, buffers):
        return F.cross_entropy(fsg.apply(model, params, batch["x"], buffers=buffers), batch["y"])

    return loss


def _batches(n: int, size: int, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(n, 3, size, size, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}
            for _ in range(count)]  # fmt: skip


def check_conv_bn_step(preset: str) -> None:
    """A conv/BatchNorm net on dp=2, batch 32 of 32x32 images: large enough that DTensor's
    batch-norm rule shards its outputs on channels (measured: 8192 positions per channel, not
    4096), where torch's convolution handlers exchanged halos with raw sends (issue 60). The
    sharded graph holds only functional collectives, no op falls back, and two aot_eager
    steps equal the unsharded ones."""
    model = _net()
    mesh = fsg.testing.mesh({"dp": 2})
    batches = _batches(32, 32, 2)
    rules = preset_rules(preset)
    step = fsg.compile_step(_loss(model), mesh, optimizer=fsg.optim.sgd(0.1), param_sharding=rules, backend="aot_eager")
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fsg.ShardingFallbackWarning)
        text = step.lower(state, batches[0]).as_text("sharded")
    assert "torch.ops.c10d." not in text and "_torchbind_obj" not in text
    assert "torch.ops._c10d_functional.all_reduce" in text  # the weight gradients, summed over the images
    fsg.testing.assert_sharded_matches_unsharded(
        _loss(model), fsg.params(model), batches, mesh, optimizer=fsg.optim.sgd(0.1), param_sharding=rules,
        buffers=fsg.buffers(model), backend="aot_eager", rtol=1e-4, atol=1e-5,
    )  # fmt: skip


# "split" is the weight's and bias's: by output channels (dim 0), as tensor parallelism would
_PLACEMENTS = {
    "batch": Shard(0),
    "split": Shard(0),
    "channels": Shard(1),
    "width": Shard(-1),
    "replicated": Replicate(),
}


def _dtensor(t: torch.Tensor, how: str, mesh) -> DTensor:
    """``t`` (the same on every rank) as a DTensor placed ``how`` on the 1-D ``mesh``."""
    if how == "partial":  # pieces that sum to t
        share = (dist.get_rank() + 1) / (mesh.size() * (mesh.size() + 1) / 2)
        return DTensor.from_local(t * share, mesh, [Partial()], run_check=False)
    placement = _PLACEMENTS[how]
    placement = Shard(placement.dim % t.dim()) if isinstance(placement, Shard) else placement
    return torch.distributed.tensor.distribute_tensor(t, mesh, [placement])


def check_conv_matches_global(case: dict) -> None:
    """``convolution.run_local`` on DTensors placed as ``case`` says (images on batch, channels,
    width, replicated or partial; the weight replicated or split by output channels; the mesh
    dim a data axis or not) equals the global convolution and its backward, run eagerly over
    gloo; its results are placed on the batch alone, the parameter gradients Partial there."""
    mesh = fsg.testing.mesh({"dp": 2}).device_mesh
    g = torch.Generator().manual_seed(case["seed"])
    n, c_in, c_out, groups, k = case["n"], case["c_in"], case["c_out"], case["groups"], case["kernel"]
    spatial = (case["size"],) * case["dims"]
    x = torch.randn(n, c_in, *spatial, generator=g, dtype=torch.float64)
    transposed = case["transposed"]
    w_shape = (c_in, c_out // groups) if transposed else (c_out, c_in // groups)
    w = torch.randn(*w_shape, *(k,) * case["dims"], generator=g, dtype=torch.float64)
    b = torch.randn(c_out, generator=g, dtype=torch.float64) if case["bias"] else None
    stride, padding, dilation = [case["stride"]] * case["dims"], [case["padding"]] * case["dims"], [1] * case["dims"]
    out_pad = [case["stride"] - 1 if transposed else 0] * case["dims"]
    config = (stride, padding, dilation, transposed, out_pad, groups)
    want = _aten.convolution.default(x, w, b, *config)
    data_dims = frozenset({0}) if case["data_axis"] else frozenset()
    dw = _dtensor(w, case["weight"], mesh)
    db = None if b is None else _dtensor(b, case["weight"], mesh)
    got = convolution.run_local(
        convolution.FORWARD, (_dtensor(x, case["x"], mesh), dw, db, *config), {}, mesh, data_dims
    )
    torch.testing.assert_close(got.full_tensor(), want, msg=f"forward {case}")
    assert all(isinstance(p, (Shard, Replicate)) and p in (Shard(0), Replicate()) for p in got.placements)
    grad_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    mask = [True, True, b is not None]
    want_grads = _aten.convolution_backward.default(grad_out, x, w, None if b is None else [c_out], *config, mask)
    got_grads = convolution.run_local(
        convolution.BACKWARD,
        (_dtensor(grad_out, case["grad_out"], mesh), _dtensor(x, case["x"], mesh), dw,
         None if b is None else [c_out], *config, mask),
        {}, mesh, data_dims,
    )  # fmt: skip
    for name, got_grad, want_grad in zip(("input", "weight", "bias"), got_grads, want_grads):
        if want_grad is None:
            assert got_grad is None
            continue
        torch.testing.assert_close(got_grad.full_tensor(), want_grad, msg=f"grad {name} {case}")


def check_guard_stops_raw_collectives() -> None:
    """Under ``Guard`` a ``torch.distributed`` op raises before it runs, other ops run; and
    torch's own handler for a convolution's backward, given images sharded on channels (a
    BatchNorm's output on a data mesh), issues one: the halo exchange ``convolution.run_local``
    does without."""
    t = torch.ones(3)
    with raw_collectives.Guard():
        assert torch.equal(t + 1, torch.full((3,), 2.0))
        with pytest.raises(raw_collectives.RawCollectiveError, match="c10d.allreduce_"):
            dist.all_reduce(t)
    assert torch.equal(t, torch.ones(3))  # never reduced
    mesh = fsg.testing.mesh({"dp": 2}).device_mesh
    x = torch.distributed.tensor.distribute_tensor(torch.randn(2, 4, 8, 8), mesh, [Shard(1)])
    w = torch.distributed.tensor.distribute_tensor(torch.randn(4, 4, 3, 3), mesh, [Replicate()])
    config = (None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    with raw_collectives.Guard(), pytest.raises(raw_collectives.RawCollectiveError, match="c10d.send"):
        _aten.convolution_backward.default(x, x, w, *config)
