"""Functions the multi-rank tests run on every rank (importable by name in the workers)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fsg
import fsg.sharding
import fsg.testing
from tests.helpers import mlp, mse_loss_fn, regression_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def exact_rules(specs: dict[str, tuple]) -> fsg.sharding.Rules:
    return fsg.sharding.rules([(name.replace(".", r"\."), fsg.P(*spec)) for name, spec in specs.items()])


def check_mlp(axes: dict, specs: dict, batch_spec: tuple) -> float:
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    batches = [regression_batch(n=16, seed=i) for i in range(3)]
    fsg.testing.assert_sharded_matches_unsharded(
        mse_loss_fn(model), fsg.params(model), batches, fsg.testing.mesh(axes),
        optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1),
        param_sharding=exact_rules(specs), batch_sharding=fsg.P(*batch_spec),
    )  # fmt: skip
    return 0.0


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    # bias=False: a key bias has an exactly zero gradient (softmax is shift-invariant), and Adam
    # would amplify its reassociation noise to full-size updates.
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False))


def gpt_batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, 32, (4, 17), generator=g)
        out.append({"x": x[:, :-1], "y": x[:, 1:]})
    return out


def gpt_loss(model):
    def loss_fn(params, batch):
        return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])

    return loss_fn


def check_gpt(axes: dict, specs: dict, batch_spec: tuple) -> float:
    model = tiny_gpt()
    fsg.testing.assert_sharded_matches_unsharded(
        gpt_loss(model), fsg.params(model), gpt_batches(), fsg.testing.mesh(axes),
        optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1),
        param_sharding=exact_rules(specs), batch_sharding=fsg.P(*batch_spec), rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    return 0.0


def preset_rules(preset: str) -> fsg.sharding.Rules:
    return {
        "dp": fsg.sharding.data_parallel(),
        "fsdp": fsg.sharding.fsdp("dp"),
        "tp": fsg.sharding.tensor_parallel("tp"),
        "fsdp_tp": fsg.sharding.fsdp_tensor_parallel("dp", "tp"),
    }[preset]


# Muon's bfloat16 iteration turns a 1-ulp change of a gradient element into a change of the
# whole update: eager torch.optim.Muon on this model, its gradients scaled by 1 + 1e-6 * noise
# (float32 reassociation's size), ends 3 steps up to 1.6e-3 away (measured 2026-12-04). A sharded
# step reassociates its sums, so it is held to that spread, not to float32 rounding.
MUON_SPREAD = 2e-3


def muon_groups() -> fsg.optim.GradientTransformation:
    """Muon for the transformer blocks' 2-D weights, AdamW for the rest (docs/optimizers.md)."""
    hidden = lambda p: {k: "muon" if v.ndim == 2 and k.startswith("blocks.") else "adamw" for k, v in p.items()}  # noqa: E731
    return fsg.optim.multi_transform({"muon": fsg.optim.muon(0.02), "adamw": fsg.optim.adamw(1e-2, weight_decay=0.1)}, hidden)


def check_weighted_accumulation(axes: dict, preset: str) -> None:
    """``accum_steps=2`` with ``microbatch_weight`` (the count of labelled tokens; a random half
    of the targets ignored) sharded equals unsharded: the weights are global counts."""
    model = tiny_gpt()

    def loss_fn(params, batch):
        logits = fsg.apply(model, params, batch["x"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), ignore_index=-100)

    g = torch.Generator().manual_seed(3)
    batches = [{"x": b["x"], "y": b["y"].masked_fill(torch.rand(b["y"].shape, generator=g) < 0.5, -100)} for b in gpt_batches()]
    fsg.testing.assert_sharded_matches_unsharded(
        loss_fn, fsg.params(model), batches, fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1),
        param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp"), rtol=1e-4, atol=1e-5, accum_steps=2,
        microbatch_weight=lambda mb: (mb["y"] != -100).sum(),
    )  # fmt: skip


def verify_muon(axes: dict, preset: str) -> None:
    """``compile_step(verify=True)`` with ``muon_groups()``: the float64 check of the sharded step
    against the unsharded one passes (each rank orthogonalizes the gathered matrix)."""
    model = tiny_gpt()
    step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), optimizer=muon_groups(),
                            param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp") if "dp" in axes else fsg.P(),
                            backend="eager", verify=True)  # fmt: skip
    step(step.init(fsg.params(model)), gpt_batches(1)[0])


OPTIMIZERS = {
    "adamw": lambda: fsg.optim.adamw(1e-2, weight_decay=0.1),
    "muon": muon_groups,
    "adafactor": lambda: fsg.optim.adafactor(1e-2, weight_decay=0.01),
    # NAdam's 0-d momentum-schedule product and RAdam's rectification beside sharded moments
    "nadam_radam": lambda: fsg.optim.multi_transform(
        {"nadam": fsg.optim.nadam(1e-2, weight_decay=0.01, decoupled_weight_decay=True), "radam": fsg.optim.radam(1e-2)},
        lambda p: {k: "nadam" if v.ndim == 2 else "radam" for k, v in p.items()},
    ),
}


def check_gpt_preset(axes: dict, preset: str, fused_optimizer: bool | None = None, optimizer: str = "adamw") -> int:
    """Sharded == unsharded for a preset, with one of ``OPTIMIZERS``; returns how many fused
    AdamW nodes the sharded step's graph has."""
    muon = optimizer == "muon"
    rules = preset_rules(preset)
    model = tiny_gpt()
    batch_spec = fsg.P("dp") if "dp" in axes else fsg.P()
    fsg.testing.assert_sharded_matches_unsharded(
        gpt_loss(model), fsg.params(model), gpt_batches(), fsg.testing.mesh(axes),
        optimizer=OPTIMIZERS[optimizer](),
        param_sharding=rules, batch_sharding=batch_spec, rtol=1e-4, atol=MUON_SPREAD if muon else 1e-5,
        fused_optimizer=fused_optimizer,
    )  # fmt: skip
    step = fsg.compile_step(
        gpt_loss(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1),
        param_sharding=rules, batch_sharding=batch_spec, backend="eager", fused_optimizer=fused_optimizer,
    )  # fmt: skip
    return step.lower(step.init(fsg.params(model)), gpt_batches(1)[0]).as_text().count("fsg.fused_adamw_")


def check_gpt_fused_loss(axes: dict, preset: str) -> int:
    """The GPT's own loss (``fsg.nn.linear_cross_entropy``, the head fused with the loss)
    sharded == unsharded; returns how many fused loss nodes the per-rank graph has."""
    rules = preset_rules(preset)
    model = tiny_gpt()
    batch_spec = fsg.P("dp") if "dp" in axes else fsg.P()

    def loss_fn(params, batch):
        return fsg.apply(model, params, batch["x"], batch["y"])

    fsg.testing.assert_sharded_matches_unsharded(
        loss_fn, fsg.params(model), gpt_batches(), fsg.testing.mesh(axes),
        optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1),
        param_sharding=rules, batch_sharding=batch_spec, rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    step = fsg.compile_step(
        loss_fn, fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2), param_sharding=rules,
        batch_sharding=batch_spec, backend="eager",
    )  # fmt: skip
    return step.lower(step.init(fsg.params(model)), gpt_batches(1)[0]).as_text().count("fsg.linear_cross_entropy_sum")


def inductor_options(axes: dict | None) -> object:
    """The Inductor options stage 4 will compile a step with, on a mesh and on one device."""
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), fsg.testing.mesh(axes) if axes else None, optimizer=fsg.optim.sgd(0.1))
    state = step.init(fsg.params(model))
    batch = regression_batch(n=16)
    signature = step._signature(state, batch)[0]
    return step._compile((signature, step._flags.now()), state, batch).fn._options


def collectives_of(axes: dict, preset: str, model_name: str = "mlp", bucket_mb=None) -> list[tuple]:
    """The collectives table of one step (one all-reduce per gradient unless ``bucket_mb``),
    and the local bytes of each param."""
    mesh = fsg.testing.mesh(axes)
    if model_name == "tp_mlp":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        rules = fsg.sharding.rules(
            [(r"2\.weight", fsg.P("tp", None)), (r"2\.bias", fsg.P("tp")), (r"4\.weight", fsg.P(None, "tp"))]
        )
        batch = {"x": torch.randn(16, 8), "y": torch.randn(16, 8)}
        batch_spec = fsg.P()
    else:
        model = mlp(d_in=8, d_hidden=32, d_out=4)
        rules = fsg.sharding.fsdp("dp") if preset == "fsdp" else fsg.sharding.data_parallel()
        batch = regression_batch(n=16)
        batch_spec = fsg.P("dp")
    step = fsg.compile_step(
        mse_loss_fn(model), mesh, optimizer=fsg.optim.sgd(0.1), param_sharding=rules,
        batch_sharding=batch_spec, backend="eager", bucket_mb=bucket_mb,
    )  # fmt: skip
    state = step.init(fsg.params(model))
    table = [tuple(c) for c in step.lower(state, batch).collectives()]
    param_bytes = sorted(p.to_local().numel() * 4 for p in state.params.values())
    return table, param_bytes


def expect_error(axes: dict, case: str) -> str:
    mesh = fsg.testing.mesh(axes)
    model = mlp(d_in=8, d_hidden=30, d_out=4)
    if case == "unknown_axis":
        rules = fsg.sharding.rules([(r"0\.weight", fsg.P("mp", None))])
    elif case == "indivisible":
        rules = fsg.sharding.rules([(r"0\.bias", fsg.P("dp"))])  # 30 over 4 ranks
    else:
        rules = fsg.sharding.data_parallel()

    def no_rule_loss(params, batch):
        out = fsg.apply(model, params, batch["x"])
        # no DTensor rule, and not an ATen op, so fsg cannot run it replicated on its own say
        return torch.ops.fsg_test.unruled(out).mean()

    loss_fn = no_rule_loss if case == "no_rule" else mse_loss_fn(model)
    step = fsg.compile_step(loss_fn, mesh, optimizer=fsg.optim.sgd(0.1), param_sharding=rules, backend="eager")
    try:
        state = step.init(fsg.params(model))
        step(state, regression_batch(n=16))
    except fsg.FsgError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@torch.library.custom_op("fsg_test::unruled", mutates_args=())
def unruled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@unruled.register_fake
def _(x):
    return torch.empty_like(x)


unruled.register_autograd(lambda ctx, grad: grad * 3)


# --- checkpoints across meshes ---------------------------------------------------------


def _ckpt_step(axes: dict | None, preset: str):
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    rules = {
        "fsdp": fsg.sharding.fsdp("dp"),
        "dp": fsg.sharding.data_parallel(),
        "tp": exact_rules({"0.weight": ("tp", None), "0.bias": ("tp",), "2.weight": (None, "tp")}),
    }[preset]
    mesh = fsg.testing.mesh(axes) if axes else None
    batch_spec = fsg.P("dp") if axes and "dp" in axes else fsg.P()
    step = fsg.compile_step(
        mse_loss_fn(model), mesh, optimizer=fsg.optim.adamw(1e-2), param_sharding=rules if mesh else None,
        batch_sharding=batch_spec, backend="eager",
    )  # fmt: skip
    return step, model


def _full_leaves(state) -> dict:
    from torch.distributed.tensor import DTensor

    from fsg._src import tree

    leaves, _ = tree.flatten(state)
    return {
        path: (leaf.full_tensor() if isinstance(leaf, DTensor) else leaf).clone()
        for path, leaf in zip(tree.leaf_paths(state, "state"), leaves)
    }


def save_trained(path: str, axes: dict | None, preset: str) -> dict:
    """Two steps on this mesh, then a checkpoint; returns every leaf in full."""
    step, model = _ckpt_step(axes, preset)
    state = step.init(fsg.params(model))
    for i in range(2):
        state, _ = step(state, regression_batch(seed=i))
    fsg.checkpoint.save(path, state, metadata={"axes": axes})
    return _full_leaves(state)


def restore_onto(path: str, axes: dict | None, preset: str) -> tuple[dict, int]:
    """Restores onto this mesh; returns every leaf in full and the bytes this rank read."""
    from fsg._src.checkpoint import _io

    step, model = _ckpt_step(axes, preset)
    like = step.init(fsg.params(mlp(seed=7)))  # other values: only the layout matters
    counted = [0]
    original = _io.PieceReader.read

    def counting(self, file, offset, nbytes, crc, where):
        counted[0] += nbytes
        return original(self, file, offset, nbytes, crc, where)

    _io.PieceReader.read = counting
    try:
        state = fsg.checkpoint.restore(path, like=like)
    finally:
        _io.PieceReader.read = original
    state, _ = step(state, regression_batch(seed=9))  # and it trains on
    return _full_leaves(fsg.checkpoint.restore(path, like=like)), counted[0]


# --- an op whose sharding rule refuses sharded inputs: the replicated fallback ----------


@torch.library.custom_op("fsg_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


double.register_autograd(lambda ctx, grad: grad * 2)


def _register_refusing_rule():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.fsg_test.double.default)
    def _strategy(x):
        if not all(isinstance(p, Replicate) for p in x.placements):
            raise RuntimeError("fsg_test::double refuses sharded inputs")
        return [([Replicate()], [Replicate()])]


def check_fallback(axes: dict) -> list[str]:
    import warnings

    _register_refusing_rule()
    model = mlp()

    def loss_fn(params, batch):
        out = torch.ops.fsg_test.double(fsg.apply(model, params, batch["x"]))
        return ((out - batch["y"]) ** 2).mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsg.testing.assert_sharded_matches_unsharded(
            loss_fn, fsg.params(model), [regression_batch(seed=i) for i in range(2)], fsg.testing.mesh(axes),
            optimizer=fsg.optim.sgd(0.1),
        )  # fmt: skip
    return [str(w.message) for w in caught if issubclass(w.category, fsg.ShardingFallbackWarning)]


def fsdp_gather_bytes(axes: dict, compute: str) -> tuple[int, int]:
    """All-gathered bytes of one FSDP step with the given compute dtype, and the local
    float32 parameter bytes."""
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    policy = fsg.Policy(param=torch.float32, compute=getattr(torch, compute))
    step = fsg.compile_step(
        mse_loss_fn(model), fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1),
        param_sharding=fsg.sharding.fsdp("dp"), precision=policy, backend="eager",
    )  # fmt: skip
    state = step.init(fsg.params(model))
    rows = step.lower(state, regression_batch(n=16)).collectives()
    gathered = sum(r.bytes for r in rows if r.kind == "all_gather_into_tensor")
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in state.params.values())
    state, metrics = step(state, regression_batch(n=16))
    assert torch.isfinite(metrics["loss"])
    return gathered, local


def check_accumulation(axes: dict, preset: str) -> list[str]:
    """Sharded == unsharded with accum_steps=2; returns the collective kinds of the step."""
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    rules = fsg.sharding.fsdp("dp") if preset == "fsdp" else fsg.sharding.data_parallel()
    batches = [regression_batch(n=16, seed=i) for i in range(2)]
    fsg.testing.assert_sharded_matches_unsharded(
        mse_loss_fn(model), fsg.params(model), batches, fsg.testing.mesh(axes),
        optimizer=fsg.optim.adamw(1e-2), param_sharding=rules, accum_steps=2,
    )  # fmt: skip
    step = fsg.compile_step(
        mse_loss_fn(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2), param_sharding=rules,
        accum_steps=2, backend="eager",
    )  # fmt: skip
    return sorted({row.kind for row in step.lower(step.init(fsg.params(model)), batches[0]).collectives()})


def _four_layer_mlp() -> nn.Module:
    layers = [nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 4))


def bucketed_data_parallel(bucket_mb: float, preset: str = "dp", compute: str = "float32") -> dict:
    """A 4-layer MLP under data parallelism (or FSDP) with ``bucket_mb``: the collectives
    table, where the first gradient collective sits in the local graph, and 3 steps against
    unsharded."""
    torch.manual_seed(0)
    model = _four_layer_mlp()
    mesh = fsg.testing.mesh({"dp": 2})
    rules = fsg.sharding.fsdp("dp") if preset == "fsdp" else None
    policy = fsg.Policy(compute=getattr(torch, compute))
    tolerance = dict(rtol=1e-4, atol=1e-5) if compute == "float32" else dict(rtol=2e-2, atol=2e-3)
    step = fsg.compile_step(
        mse_loss_fn(model), mesh, optimizer=fsg.optim.sgd(0.1), backend="eager", bucket_mb=bucket_mb,
        param_sharding=rules, precision=policy,
    )  # fmt: skip
    batch = {"x": torch.randn(16, 16), "y": torch.randn(16, 4)}
    state = step.init(fsg.params(model))
    lowered = step.lower(state, batch)
    nodes = list(lowered.graph_module.graph.nodes)
    kind = "reduce_scatter" if preset == "fsdp" else "all_reduce"
    grads_ar = [i for i, n in enumerate(nodes) if kind in str(n.target) and n.args[1] == "sum"]
    matmuls = [i for i, n in enumerate(nodes) if str(n.target) in ("aten.mm.default", "aten.addmm.default")]
    fsg.testing.assert_sharded_matches_unsharded(
        mse_loss_fn(model), fsg.params(model), [batch] * 3, mesh, optimizer=fsg.optim.sgd(0.1, momentum=0.9),
        param_sharding=rules, batch_sharding=fsg.P("dp"), bucket_mb=bucket_mb, precision=policy, **tolerance,
    )  # fmt: skip
    return {
        "table": [tuple(c) for c in lowered.collectives()],
        "first_grad_all_reduce": grads_ar[0],
        "last_matmul": matmuls[-1],
        "param_bytes": sum(p.numel() * 4 for p in fsg.params(model).values()),
    }


def fused_update_order(bucket_mb: float, preset: str = "dp", accum_steps: int = 1) -> dict:
    """The tiny GPT on ``Mesh({"dp": 2})`` with the fused AdamW and small buckets: against the
    unsharded step, and the order of the gradient waits and the updates in the graph's tail."""
    model = tiny_gpt()
    mesh = fsg.testing.mesh({"dp": 2})
    options = dict(
        optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), fused_optimizer=True, bucket_mb=bucket_mb,
        param_sharding=preset_rules(preset), accum_steps=accum_steps,
    )  # fmt: skip
    fsg.testing.assert_sharded_matches_unsharded(
        gpt_loss(model), fsg.params(model), gpt_batches(), mesh, rtol=1e-4, atol=1e-5, **options
    )
    step = fsg.compile_step(gpt_loss(model), mesh, backend="eager", **options)
    nodes = list(step.lower(step.init(fsg.params(model)), gpt_batches(1)[0]).graph_module.graph.nodes)
    waits = {}
    for update in (n for n in nodes if "fused_adamw" in str(n.target)):
        for grad in update.args[1]:  # up through the bucket's split and views to its wait
            while "wait_tensor" not in str(grad.target):
                grad = grad.args[0]
            waits[grad] = "wait"
    tail = [waits.get(n) or "update" for n in nodes if n in waits or "fused_adamw" in str(n.target)]
    waited = [n.args[0] for n in nodes if n in waits]
    return {
        "updates": tail.count("update"),
        "sequence": tail,
        "issue_order_matches": waited == sorted(waited, key=nodes.index),
    }


def reduce_dtype_bytes(preset: str, reduce: str | None) -> dict:
    """An MLP on ``Mesh({"dp": 2})`` with ``Policy(reduce=...)``: the bytes of its gradient
    reductions, the dtypes the fused AdamW reads its gradients in, and 3 steps against the
    unsharded step (float32 throughout)."""
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    mesh = fsg.testing.mesh({"dp": 2})
    rules = preset_rules(preset)
    policy = fsg.Policy(reduce=getattr(torch, reduce) if reduce else None)
    options = dict(optimizer=fsg.optim.adamw(1e-2), fused_optimizer=True, precision=policy, param_sharding=rules)
    batches = [regression_batch(n=16, seed=i) for i in range(3)]
    tolerance = dict(rtol=1e-4, atol=1e-5) if reduce is None else dict(rtol=2e-2, atol=2e-3)
    fsg.testing.assert_sharded_matches_unsharded(
        mse_loss_fn(model), fsg.params(model), batches, mesh, batch_sharding=fsg.P("dp"), **tolerance, **options
    )
    step = fsg.compile_step(mse_loss_fn(model), mesh, backend="eager", **options)
    lowered = step.lower(step.init(fsg.params(model)), batches[0])
    kind = "reduce_scatter_tensor" if preset == "fsdp" else "all_reduce"
    update = next(n for n in lowered.graph_module.graph.nodes if "fused_adamw" in str(n.target))
    return {
        "bytes": sum(r.bytes for r in lowered.collectives() if r.kind == kind),
        "grad_dtypes": sorted({str(g.meta["val"].dtype) for g in update.args[1]}),
    }


def _graph_nodes(step, batch, model) -> list:
    return list(step.lower(step.init(fsg.params(model)), batch).graph_module.graph.nodes)


def fsdp_gather_order(bucket_mb: float) -> dict:
    """A 4-layer MLP under FSDP with bf16 compute and ``bucket_mb``: 3 steps against unsharded,
    and where the parameter all-gathers and their waits sit in the local graph."""
    torch.manual_seed(0)
    model = _four_layer_mlp()
    mesh = fsg.testing.mesh({"dp": 2})
    options = dict(
        optimizer=fsg.optim.sgd(0.1), param_sharding=fsg.sharding.fsdp("dp"), bucket_mb=bucket_mb,
        precision=fsg.Policy(compute=torch.bfloat16),
    )  # fmt: skip
    batch = {"x": torch.randn(16, 16), "y": torch.randn(16, 4)}
    fsg.testing.assert_sharded_matches_unsharded(
        mse_loss_fn(model), fsg.params(model), [batch] * 3, mesh, rtol=2e-2, atol=2e-3, **options
    )
    step = fsg.compile_step(mse_loss_fn(model), mesh, backend="eager", **options)
    nodes = _graph_nodes(step, batch, model)
    gathers = [i for i, n in enumerate(nodes) if "all_gather" in str(n.target)]
    matmuls = [i for i, n in enumerate(nodes) if str(n.target) in ("aten.mm.default", "aten.addmm.default")]
    table = {row.kind: row for row in step.lower(step.init(fsg.params(model)), batch).collectives()}
    return {
        "issued": gathers,
        "waits": [nodes.index(next(iter(nodes[i].users))) for i in gathers],
        "dtypes": sorted({str(nodes[i].args[0].meta["val"].dtype) for i in gathers}),
        "gathered_bytes": table["all_gather_into_tensor"].bytes,
        "param_bytes_bf16": sum(p.numel() * 2 for p in fsg.params(model).values()),
        "first_matmul": matmuls[0],
        "last_matmul": matmuls[-1],
    }


def small_collective_order() -> dict:
    """The tiny GPT on ``Mesh({"dp": 2})``: where the forward's token-count all-reduce and the
    loss metric's wait sit in the local graph, relative to the matmuls."""
    model = tiny_gpt()
    step = fsg.compile_step(
        gpt_loss(model), fsg.testing.mesh({"dp": 2}), optimizer=fsg.optim.sgd(0.1), backend="eager"
    )
    nodes = _graph_nodes(step, gpt_batches(1)[0], model)
    matmuls = [
        i for i, n in enumerate(nodes) if str(n.target) in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
    ]
    small = [n for n in nodes if "all_reduce" in str(n.target) and n.args[0].meta["val"].numel() == 1]
    count = next(n for n in small if n.args[0].meta["val"].dtype == torch.int64)
    loss = next(n for n in small if n.args[0].meta["val"].is_floating_point() and n.args[1] == "sum")
    return {
        "count_issued": nodes.index(count),
        "count_waited": nodes.index(next(iter(count.users))),
        "loss_issued": nodes.index(loss),
        "loss_waited": nodes.index(next(iter(loss.users))),
        "first_matmul": matmuls[0],
        "last_matmul": matmuls[-1],
    }


def check_batch_norm_running_stats(axes: dict, preset: str, momentum: float | None = 0.1, sync: bool = False) -> None:
    """A Linear + BatchNorm1d (running statistics tracked) + Linear under ``preset`` with the
    batch sharded: losses, params and the running statistics equal the unsharded step's
    (global-batch statistics, as SyncBatchNorm). ``sync``: converted to SyncBatchNorm, which
    fsg runs as that BatchNorm (``trace/stand_ins.py``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, momentum=momentum), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model

    def loss_fn(params, batch, buffers):
        out = fsg.apply(model, params, batch["x"], buffers=buffers)
        return ((out - batch["y"]) ** 2).mean()

    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(16, 4, generator=g) * 3 + 1, "y": torch.randn(16, 2, generator=g)} for _ in range(3)]
    fsg.testing.assert_sharded_matches_unsharded(
        loss_fn, fsg.params(model), batches, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1),
        param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp"), buffers=fsg.buffers(model),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def sync_batch_norm_of_a_subgroup(axes: dict) -> str:
    """A SyncBatchNorm over one rank of two: the UnsupportedError's message."""
    groups = [dist.new_group([0]), dist.new_group([1])]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SyncBatchNorm(8, process_group=groups[dist.get_rank()]))
    step = fsg.compile_step(lambda p, b, bufs: fsg.apply(model, p, b, buffers=bufs).square().mean(),
                            fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), batch_sharding=fsg.P("dp"))  # fmt: skip
    try:
        step(step.init(fsg.params(model), buffers=fsg.buffers(model)), torch.randn(8, 4))
    except fsg.UnsupportedError as e:
        return str(e)
    return "no error"


# --- a tensor the loss closes over: a constant (get_attr) of the per-rank graph -----------


def check_closed_over_constant(axes: dict) -> None:
    """The loss's mean reads a tensor it closes over; stage 3 issues that mean's all-reduce
    first thing (its inputs are the batch and parameters), which must not move it above the
    constant's definition (the per-rank graph failed to lint before)."""
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    offset = torch.linspace(-1.0, 1.0, 4)

    def loss_fn(params, batch):
        return ((fsg.apply(model, params, batch["x"]) - offset - batch["y"]) ** 2).mean()

    fsg.testing.assert_sharded_matches_unsharded(
        loss_fn, fsg.params(model), [regression_batch(seed=i) for i in range(2)], fsg.testing.mesh(axes),
        optimizer=fsg.optim.sgd(0.1),
    )  # fmt: skip


# --- plain tensors in a multi-rank checkpoint: saved once, as replicated values ----------


def save_plain(path: str, differ: bool) -> str | None:
    """Saves ``{"x": plain, "n": 3}`` on every rank (rank 1's ``x`` off by one if ``differ``);
    returns the error message, or ``None`` after a save that restores here."""
    import torch.distributed as dist

    x = torch.arange(6.0).reshape(2, 3) + (dist.get_rank() if differ else 0)
    try:
        fsg.checkpoint.save(path, {"x": x, "n": 3})
    except fsg.CheckpointError as exc:
        return str(exc)
    restored = fsg.checkpoint.restore(path, like={"x": torch.zeros(2, 3), "n": 0})
    assert torch.equal(restored["x"], x) and restored["n"] == 3
    return None


# --- packed sequences with the batch sharded ------------------------------------------------


class PackedClassifier(torch.nn.Module):
    """An embedding, a packed bidirectional LSTM (``enforce_sorted=False``: the lengths sorted
    across the batch) and a head on the last states; the loss adds the unpacked outputs."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.lstm = torch.nn.LSTM(8, 6, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, ids, lengths, y):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = self.lstm(packed)
        padded, lengths = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        logits = self.head(torch.cat([h[-2], h[-1]], -1))
        return torch.nn.functional.cross_entropy(logits, y) + padded.square().sum() / lengths.sum()


def check_packed_sequences(axes: dict, preset: str) -> None:
    """``PackedClassifier`` with the batch and its lengths sharded: losses and params equal
    the unsharded step's (``trace/packed_sequences.py``)."""
    torch.manual_seed(0)
    model = PackedClassifier()
    g = torch.Generator().manual_seed(1)
    batches = [{"ids": torch.randint(1, 20, (8, 6), generator=g), "len": torch.randint(1, 7, (8,), generator=g),
                "y": torch.randint(0, 3, (8,), generator=g)} for _ in range(3)]  # fmt: skip
    fsg.testing.assert_sharded_matches_unsharded(
        lambda p, b: fsg.apply(model, p, b["ids"], b["len"], b["y"]), fsg.params(model), batches,
        fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), param_sharding=preset_rules(preset),
        batch_sharding=fsg.P("dp"), rtol=1e-5, atol=1e-6,
    )  # fmt: skip
