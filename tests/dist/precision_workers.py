"""Functions the multi-rank precision tests run on every rank (module-level: they are pickled)."""

from __future__ import annotations

import torch

import fsg
from tests.dist.workers import GPT, GPTConfig, _full_leaves, gpt_batches, gpt_loss, preset_rules, tiny_gpt
from tests.helpers import mlp, mse_loss_fn

ROWWISE = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
POLICIES = {
    "bf16": fsg.Policy(compute=torch.bfloat16),
    "rowwise": ROWWISE,
    "tensorwise": fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8()),
}


def float8_matches_unsharded(axes: dict, preset: str, policy: str) -> tuple[int, int, int]:
    """The tiny GPT's step under ``preset`` equals the unsharded step with the same policy
    (``"rowwise"``, ``"tensorwise"`` or ``"bf16"``, the reference for how close bf16 steps
    come); returns how many ``_scaled_mm``, fused GELU-gradient casts and all-reduces the
    sharded step's graph holds."""
    precision = POLICIES[policy]
    model = tiny_gpt()
    # SGD, not Adam: Adam turns a gradient's last-bit difference near zero into a whole update
    options = dict(optimizer=fsg.optim.sgd(0.1), param_sharding=preset_rules(preset),
                   batch_sharding=fsg.P("dp"), precision=precision)  # fmt: skip
    fsg.testing.assert_sharded_matches_unsharded(
        gpt_loss(model), fsg.params(model), gpt_batches(), fsg.testing.mesh(axes), rtol=2e-2, atol=2e-3, **options
    )
    step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), backend="eager", **options)
    counts = step.lower(step.init(fsg.params(model)), gpt_batches(1)[0]).op_counts()
    reduces = counts.get("_c10d_functional.all_reduce", 0)
    return counts.get("aten._scaled_mm", 0), counts.get("fsg.gelu_backward_fp8", 0), reduces


def float8_under_tensor_parallel_is_refused(axes: dict, policy: str) -> str:
    model = tiny_gpt()
    step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2),
                            param_sharding=preset_rules("tp"), precision=POLICIES[policy], backend="eager")  # fmt: skip
    try:
        step(step.init(fsg.params(model)), gpt_batches(1)[0])
    except fsg.FsgError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def first_losses(axes: dict, preset: str, policy: str) -> tuple[float, float]:
    """The first step's loss of the tiny GPT on the mesh and on one device (the whole batch):
    a rank's rows quantized with the unsharded step's scales give that step's per-row losses."""
    model = tiny_gpt()
    batch = gpt_batches(1)[0]
    options = dict(optimizer=fsg.optim.sgd(0.1), precision=POLICIES[policy], backend="eager")
    one = fsg.compile_step(gpt_loss(model), **options)
    mesh = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), param_sharding=preset_rules(preset),
                            batch_sharding=fsg.P("dp"), **options)  # fmt: skip
    return (
        float(mesh(mesh.init(fsg.params(model)), batch)[1]["loss"]),
        float(one(one.init(fsg.params(model)), batch)[1]["loss"]),
    )


def local_rewrite_keeps_the_step(axes: dict, preset: str, rewrite: str) -> tuple[dict, bool]:
    """The tiny GPT's bf16 step on the mesh with a stage-3 pass forced on CPU (``rewrite``:
    ``"gemm_epilogues"``, whose ops run the aten ops they replace there, or ``"batch_casts"``)
    against the same step without it: returns how many of the pass's ops the rank's graph holds
    and whether three steps left every local parameter bit for bit as the plain step did."""
    import contextlib
    import importlib

    module = importlib.import_module(f"fsg._src.passes.{rewrite}")
    ops = {"gemm_epilogues": ("fsg.linear_gelu.default(", "fsg.mm_gelu_backward.default("),
           "batch_casts": ("fsg.cast_flat.default(",)}[rewrite]  # fmt: skip
    runs = []
    for forced in (False, True):
        model = tiny_gpt()
        step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2),
                                param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp") if "dp" in axes else None,
                                precision=POLICIES["bf16"], backend="eager")  # fmt: skip
        with module.force() if forced else contextlib.nullcontext():
            state = step.init(fsg.params(model))
            text = step.lower(state, gpt_batches(1)[0]).as_text()
            for batch in gpt_batches():
                state, _ = step(state, batch)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in state.params.values()]
        runs.append(({op: text.count(op) for op in ops}, local))
    (_, plain), (counts, rewritten) = runs
    return counts, all(torch.equal(a, b) for a, b in zip(plain, rewritten))


def float8_gather_is_the_compute_gather(axes: dict, backend: str) -> tuple[bool, float, list[float], dict, dict]:
    """Three SGD steps of the tiny GPT under FSDP with tensorwise FP8, its weights gathered in
    the compute dtype and in FP8 (``Float8(all_gather=...)``): whether the losses and the final
    state are bit for bit equal, the largest difference of a loss or state element, the FP8
    run's losses, and each run's gathered bytes by dtype. The GPT has biases: FSDP gathers them
    too, and a bias an FP8 matmul adds is not one of its operands (it stays in bf16)."""
    torch.manual_seed(0)
    model, runs = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=True)), []
    for all_gather in ("compute", "fp8"):
        precision = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(all_gather=all_gather))
        step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1),
                                param_sharding=preset_rules("fsdp"), batch_sharding=fsg.P("dp"),
                                precision=precision, backend=backend)  # fmt: skip
        state, losses = step.init(fsg.params(model)), []
        for batch in gpt_batches(3):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        gathered: dict[str, int] = {}
        for node in step.lower(state, gpt_batches(1)[0]).graph_module.graph.nodes:
            if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
                value = node.meta["val"]
                gathered[str(value.dtype)] = gathered.get(str(value.dtype), 0) + value.numel() * value.element_size()
        runs.append((torch.stack(losses), list(_full_leaves(state).values()), gathered))
    (losses_a, leaves_a, gathered_a), (losses_b, leaves_b, gathered_b) = runs
    pairs = [(losses_a, losses_b), *zip(leaves_a, leaves_b)]
    equal = all(torch.equal(a, b) for a, b in pairs)
    largest = max(float((a.double() - b.double()).abs().max()) for a, b in pairs if a.is_floating_point())
    return equal, largest, losses_b.tolist(), gathered_a, gathered_b
