"""Functions the multi-rank precision tests run on every rank (module-level: they are pickled)."""

from __future__ import annotations

import io
import logging

import torch

import fsg
from tests.dist.workers import GPT, GPTConfig, _full_leaves, gpt_batches, gpt_loss, preset_rules, tiny_gpt

ROWWISE = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
POLICIES = {
    "bf16": fsg.Policy(compute=torch.bfloat16),
    "rowwise": ROWWISE,
    "tensorwise": fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8()),
}


def float8_matches_unsharded(axes: dict, preset: str, policy: str) -> tuple[int, int, int, int]:
    """The tiny GPT's step under ``preset`` equals the unsharded step with the same policy
    (``"rowwise"``, ``"tensorwise"`` or ``"bf16"``, the reference for how close bf16 steps
    come); returns how many ``_scaled_mm``, fused GELU-gradient casts, all-reduces and
    summing collectives (the gradients' buckets, and a mean loss's) the sharded step's graph
    holds."""
    precision = POLICIES[policy]
    model = tiny_gpt()
    # SGD, not Adam: Adam turns a gradient's last-bit difference near zero into a whole update
    options = dict(optimizer=fsg.optim.sgd(0.1), param_sharding=preset_rules(preset),
                   batch_sharding=fsg.P("dp"), precision=precision)  # fmt: skip
    fsg.testing.assert_sharded_matches_unsharded(
        gpt_loss(model), fsg.params(model), gpt_batches(), fsg.testing.mesh(axes), rtol=2e-2, atol=2e-3, **options
    )
    step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), backend="eager", **options)
    lowered = step.lower(step.init(fsg.params(model)), gpt_batches(1)[0])
    counts = lowered.op_counts()
    reduces = counts.get("_c10d_functional.all_reduce", 0)
    summing = (torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.reduce_scatter_tensor.default)
    sums = sum(n.target in summing and n.args[1] in ("sum", "avg") for n in lowered.graph_module.graph.nodes)
    return counts.get("aten._scaled_mm", 0), counts.get("fsg.gelu_backward_fp8", 0), reduces, sums


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
    against the same step without it: returns how many of the pass's ops (and collectives) the
    rank's graph holds and whether three steps left every local parameter bit for bit as the
    plain step did; the rewrite must not change how many collectives of each kind the graph
    issues (its buckets stay packed)."""
    from fsg._src.passes.options import Fusions

    collectives = tuple(f"_c10d_functional.{op}.default(" for op in ("all_gather_into_tensor", "all_reduce",
                                                                      "reduce_scatter_tensor"))  # fmt: skip
    ops = {"gemm_epilogues": ("fsg.linear_gelu.default(", "fsg.mm_gelu_backward.default("),
           "batch_casts": ("fsg.cast_flat.default(",)}[rewrite] + collectives  # fmt: skip
    runs = []
    for forced in (False, True):
        model = tiny_gpt()
        step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2),
                                param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp") if "dp" in axes else None,
                                precision=POLICIES["bf16"], backend="eager",
                                fusions=Fusions(on_cpu={rewrite} if forced else frozenset()))  # fmt: skip
        state = step.init(fsg.params(model))
        text = step.lower(state, gpt_batches(1)[0]).as_text()
        for batch in gpt_batches():
            state, _ = step(state, batch)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in state.params.values()]
        runs.append(({op: text.count(op) for op in ops}, local))
    (plain_counts, plain), (counts, rewritten) = runs
    # the buckets stay packed: as many collectives of each kind as without the rewrite
    assert all(counts[c] == plain_counts[c] for c in collectives), (plain_counts, counts)
    return counts, all(torch.equal(a, b) for a, b in zip(plain, rewritten))


def _mlp_case(widths: tuple, bias: bool, penalized: int | None):
    """An MLP of ``widths`` (GELU between its linear layers), with ``penalized``'s weight also
    read by an L2 penalty in the loss (None: no penalty)."""
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b, bias=bias)] + ([torch.nn.GELU()] if i < len(widths) - 2 else [])
    model = torch.nn.Sequential(*layers)

    def loss_fn(params, batch):
        out = ((fsg.apply(model, params, batch["x"]).float() - batch["y"]) ** 2).mean()
        return out if penalized is None else out + 1e-3 * params[f"{2 * penalized}.weight"].float().square().sum()

    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(32, widths[0], generator=g), "y": torch.randn(32, widths[-1], generator=g)} for _ in range(3)]
    return model, loss_fn, batches


def _gather_case(case):
    """``(model, loss_fn, batches)``: ``"gpt"``, the tiny GPT with biases (FSDP gathers them too;
    a bias an FP8 matmul adds is not its operand and stays bf16), ``"gpt128"`` the same at width
    128; ``"mlp"``, three linear
    layers whose loss also reads the first weight (a penalty on it), so only the middle
    weight is read by FP8 matmuls alone (the last is the output head); a tuple:
    ``_mlp_case(*case)``."""
    torch.manual_seed(0)
    if case in ("gpt", "gpt128"):  # (at width 128 stage 2 reads some gathered weights through a no-op slice)
        width = 128 if case == "gpt128" else 16
        model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=width, bias=True))
        return model, gpt_loss(model), gpt_batches(3)
    return _mlp_case((32, 64, 64, 16), True, 0) if case == "mlp" else _mlp_case(*case)


def float8_gather_is_the_compute_gather(axes: dict, backend: str, case, fsdp_axis: str = "dp") -> dict:
    """Three SGD steps of ``_gather_case(case)`` under FSDP with tensorwise FP8, its weights
    gathered in the compute dtype and in FP8 (``Float8(all_gather=...)``): whether the losses
    and the final state are bit for bit equal (``equal``), the largest difference of a loss or
    state element, the FP8 run's losses, each run's gathered bytes and gathers by dtype
    (``compute``, ``fp8``: ``{dtype: [bytes, collectives]}``), and what the ``fsg`` logger said
    about weight gathers (``said``). The parameters are sharded over ``fsdp_axis``, the batch
    over every axis (HSDP where ``axes`` has another)."""
    model, loss_fn, batches = _gather_case(case)
    runs, said = [], io.StringIO()
    logger, handler = logging.getLogger("fsg"), logging.StreamHandler(said)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for all_gather in ("compute", "fp8"):
        precision = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(all_gather=all_gather))
        step = fsg.compile_step(loss_fn, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1),
                                param_sharding=fsg.sharding.fsdp(fsdp_axis), batch_sharding=fsg.P(tuple(axes)),
                                precision=precision, backend=backend)  # fmt: skip
        state, losses = step.init(fsg.params(model)), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        gathered: dict[str, list[int]] = {}
        for node in step.lower(state, batches[0]).graph_module.graph.nodes:
            if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
                value, row = node.meta["val"], gathered.setdefault(str(node.meta["val"].dtype), [0, 0])
                row[0], row[1] = row[0] + value.numel() * value.element_size(), row[1] + 1
        runs.append((torch.stack(losses), list(_full_leaves(state).values()), gathered))
    logger.removeHandler(handler)
    logger.setLevel(level)
    (losses_a, leaves_a, gathered_a), (losses_b, leaves_b, gathered_b) = runs
    pairs = [(losses_a, losses_b), *zip(leaves_a, leaves_b)]
    equal = all(torch.equal(a, b) for a, b in pairs)
    largest = max(float((a.double() - b.double()).abs().max()) for a, b in pairs if a.is_floating_point())
    lines = [line for line in said.getvalue().splitlines() if "gather" in line]
    return {"equal": equal, "largest": largest, "losses": losses_b.tolist(), "compute": gathered_a,
            "fp8": gathered_b, "said": "\n".join(lines)}  # fmt: skip


class _TableTimer:
    """Every bf16 GEMM 1 s, every FP8 GEMM ``1 - saved`` s; bytes and launches free."""

    name = "table"

    def __init__(self, saved: float) -> None:
        self.saved = saved

    def gemm(self, m, k, n, dtype, fp8, rowwise, fast):
        return 1.0 - self.saved if fp8 else 1.0

    def bytes_per_second(self):
        return 1e30

    def launch(self):
        return 0.0


def float8_auto_agrees_across_ranks(axes: dict, policy: str) -> tuple[int, list[float]]:
    """``Float8(filter="auto")`` on a mesh whose ranks measure opposite things (rank 0: FP8
    saves time, rank 1: it costs time): the ``_scaled_mm`` count of this rank's step and its
    losses over two steps (rank 0's choice everywhere: the steps run, their collectives match)."""
    from fsg._src.passes.float8 import cost as float8_cost

    rank = torch.distributed.get_rank()
    before = float8_cost.timer_for
    float8_cost.timer_for = lambda device: _TableTimer(0.5 if rank == 0 else -0.5)
    try:
        recipe = "rowwise" if policy == "rowwise" else "tensorwise"
        precision = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe=recipe, filter="auto"))
        model = tiny_gpt()
        step = fsg.compile_step(gpt_loss(model), fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1),
                                batch_sharding=fsg.P("dp"), precision=precision, backend="eager")  # fmt: skip
        state, losses = step.init(fsg.params(model)), []
        for batch in gpt_batches(2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return step.lower(state, gpt_batches(1)[0]).op_counts().get("aten._scaled_mm", 0), losses
    finally:
        float8_cost.timer_for = before


def weight_fusion_keeps_the_step(axes: dict, preset: str) -> tuple[int, bool]:
    """The tiny GPT's rowwise FP8 step on the mesh with ``Fusions.fp8_weights`` on against off:
    how many ``fsg::weight_fp8`` the rank's graph holds, and whether three steps left every
    local parameter bit for bit as the unfused step did (the op runs the unfused casts on CPU)."""
    from fsg._src.passes.options import Fusions

    runs = []
    for fuse in (False, True):
        model = tiny_gpt()
        step = fsg.compile_step(
            gpt_loss(model),
            fsg.testing.mesh(axes),
            optimizer=fsg.optim.sgd(0.1),
            param_sharding=preset_rules(preset),
            batch_sharding=fsg.P("dp"),
            precision=ROWWISE,
            backend="eager",
            fusions=Fusions(fp8_weights=fuse),
        )
        state = step.init(fsg.params(model))
        count = step.lower(state, gpt_batches(1)[0]).as_text().count("fsg.weight_fp8.default(")
        for batch in gpt_batches():
            state, _ = step(state, batch)
        runs.append((count, [p.to_local() if hasattr(p, "to_local") else p for p in state.params.values()]))
    (_, plain), (count, fused) = runs
    return count, all(torch.equal(a, b) for a, b in zip(plain, fused))
