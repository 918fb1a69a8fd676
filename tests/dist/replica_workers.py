"""Functions the replica-check tests run on every rank (module-level: they are pickled)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import fsg
import fsg.testing
from fsg._src.errors import ReplicaMismatchError
from fsg._src.runtime.replicas import check_replicas
from tests.dist.workers import GPT, GPTConfig, exact_rules, preset_rules
from tests.helpers import mlp, mse_loss_fn, regression_batch

_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast", "gather")


def _rules(layout: str) -> fsg.sharding.Rules:
    if layout == "dp_tp":  # the first layer's weight: sharded over tp, replicated over dp
        return exact_rules({"0.weight": ("tp", None), "0.bias": ("tp",), "2.weight": (None, "tp")})
    return preset_rules(layout)


def _step(axes: dict, layout: str, every: int | None):
    model = mlp()
    step = fsg.compile_step(
        mse_loss_fn(model), fsg.testing.mesh(axes), optimizer=fsg.optim.adamw(1e-2), param_sharding=_rules(layout),
        backend="aot_eager", check_replicas=every,
    )  # fmt: skip
    return step, step.init(fsg.params(model))


def _counting_collectives() -> tuple[dict, callable]:
    """Wraps torch.distributed's collectives to count the calls; returns (counts, undo)."""
    counts, originals = {}, {name: getattr(dist, name) for name in _COLLECTIVES}

    def wrap(name):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return counted

    for name in _COLLECTIVES:
        setattr(dist, name, wrap(name))
    return counts, lambda: [setattr(dist, name, fn) for name, fn in originals.items()]


def _one_ulp_up(t: torch.Tensor) -> None:
    """This rank's shard of ``t`` changed by one ulp in its first element, in place."""
    first = t.to_local().view(-1)[:1]
    first.add_(torch.nextafter(first, torch.full_like(first, float("inf"))) - first)


def clean_then_perturbed(axes: dict, layout: str, leaf: str, bad_rank: int) -> dict:
    """Two steps with a check after each (the step's hook), a standalone check counting its
    collectives, then ``bad_rank``'s shard of ``state.params[leaf]`` one ulp up: the
    standalone check and the step's next check must both raise."""
    step, state = _step(axes, layout, every=1)
    batch = regression_batch(n=16)
    for _ in range(2):
        state, _ = step(state, batch)  # checked after each call: must pass
    counts, undo = _counting_collectives()
    try:
        compared = check_replicas(state)
    finally:
        undo()
    out = {"counts": counts, "compared": compared, "leaves": len(fsg._src.tree.flatten(state)[0])}
    if dist.get_rank() == bad_rank:
        _one_ulp_up(state.params[leaf])
    try:
        check_replicas(state)
    except ReplicaMismatchError as exc:
        out["standalone"] = str(exc)
    try:
        step(state, batch)
    except ReplicaMismatchError as exc:
        out["step"] = str(exc)
    return out


def perturbed_unreplicated_shard(axes: dict, leaf: str) -> dict:
    """Under FSDP over every rank each shard has one holder: perturbing it is no mismatch; a
    perturbed replicated leaf (``state.step``) on one rank is."""
    step, state = _step(axes, "fsdp", every=None)
    state, _ = step(state, regression_batch(n=16))
    if dist.get_rank() == 1:
        _one_ulp_up(state.params[leaf])
    out = {"compared": check_replicas(state), "leaves": len(fsg._src.tree.flatten(state)[0])}
    if dist.get_rank() == 2:
        state.step.to_local().add_(1)
    try:
        check_replicas(state)
    except ReplicaMismatchError as exc:
        out["step_leaf"] = str(exc)
    return out


def cost_of_a_check(n_layer: int, n_embd: int, vocab: int, steps: int) -> dict:
    """Seconds per check and per step of a GPT-ish state (AdamW, dp over the world, aot_eager)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=128, n_layer=n_layer, n_head=4, n_embd=n_embd, bias=False))

    def loss_fn(params, batch):
        return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])

    step = fsg.compile_step(loss_fn, fsg.testing.mesh({"dp": dist.get_world_size()}), optimizer=fsg.optim.adamw(1e-3),
                            backend="aot_eager")  # fmt: skip
    state = step.init(fsg.params(model))
    x = torch.randint(0, vocab, (4 * dist.get_world_size(), 129), generator=torch.Generator().manual_seed(1))
    batch = {"x": x[:, :-1], "y": x[:, 1:]}
    state, _ = step(state, batch)  # compile
    check_replicas(state)  # scratch buffers
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    float(metrics["loss"])  # waits for the last step
    t1 = time.perf_counter()
    for _ in range(steps):
        check_replicas(state)
    t2 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    words = sum(t.to_local().numel() for t in fsg._src.tree.flatten(state)[0])
    return {"params": params, "state_elems": words, "step_s": (t1 - t0) / steps, "check_s": (t2 - t1) / steps}
