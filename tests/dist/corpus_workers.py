"""Runs the op corpus on every rank: each case sharded under each preset vs. unsharded.

An outcome is ``"match"`` (every new parameter and the loss equal the unsharded step's within
float32 reassociation), ``"error: <FsgError subclass>"`` (a clear refusal, before anything
ran), ``"MISMATCH ..."`` (a silent wrong result: the bug the corpus exists to catch) or
``"crash: ..."`` (an exception that is not an ``fsg.FsgError``: not a clear error either).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import fsg
import fsg.sharding
import fsg.testing
from tests.dist import op_corpus

RTOL, ATOL = 1e-4, 1e-5
PRESETS = ("dp", "fsdp", "tp")


def layout(preset: str, world: int) -> tuple[dict[str, int], fsg.sharding.Rules, fsg.P]:
    """The mesh axes, parameter rules and batch spec of a preset on ``world`` ranks: tensor
    parallel is 1-D on 2 ranks and FSDP x TP (2 x 2) on 4."""
    if preset == "dp":
        return {"dp": world}, fsg.sharding.data_parallel(), fsg.P("dp")
    if preset == "fsdp":
        return {"dp": world}, fsg.sharding.fsdp("dp"), fsg.P("dp")
    if world == 2:
        return {"tp": 2}, fsg.sharding.tensor_parallel("tp"), fsg.P()
    return {"dp": 2, "tp": world // 2}, fsg.sharding.fsdp_tensor_parallel("dp", "tp"), fsg.P("dp")


def presets_of(case: op_corpus.Case) -> tuple[str, ...]:
    return PRESETS if case.tp else PRESETS[:2]


def _gather(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _first_difference(params: dict, ref: dict) -> str | None:
    for name in sorted(ref):
        got, want = _gather(params[name]), ref[name]
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            return f"params[{name!r}] off by {(got - want).abs().max().item():.2e}"
    return None


def run_case(case: op_corpus.Case, sizes: op_corpus.Sizes, preset: str, reference) -> str:
    """One case under one preset on this rank's world; ``reference`` is the unsharded
    ``(new params, loss)``."""
    params, loss_fn, batch = case.build(sizes, torch.Generator().manual_seed(0))
    axes, rules, batch_spec = layout(preset, dist.get_world_size())
    try:
        step = fsg.compile_step(
            loss_fn, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), param_sharding=rules,
            batch_sharding=batch_spec, backend="eager", donate=False,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fsg.ShardingFallbackWarning)  # gathered, still exact
            state, metrics = step(step.init(params), batch)
    except fsg.FsgError as exc:
        return f"error: {type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - reported as an outcome, never hidden
        return f"crash: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    ref_params, ref_loss = reference
    if not torch.allclose(metrics["loss"], ref_loss, rtol=RTOL, atol=ATOL):
        return f"MISMATCH loss {metrics['loss'].item():.6g} vs {ref_loss.item():.6g}"
    differs = _first_difference(state.params, ref_params)
    return "match" if differs is None else f"MISMATCH {differs}"


def unsharded(case: op_corpus.Case, sizes: op_corpus.Sizes):
    params, loss_fn, batch = case.build(sizes, torch.Generator().manual_seed(0))
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager", donate=False)
    state, metrics = step(step.init(params), batch)
    return dict(state.params), metrics["loss"]


def run_case_presets(name: str, case_sizes: tuple) -> dict[str, str]:
    """One case of the corpus under each of its presets: ``{preset: outcome}``."""
    case, sizes = op_corpus.by_name(name), op_corpus.Sizes(*case_sizes)
    reference = unsharded(case, sizes)
    return {preset: run_case(case, sizes, preset, reference) for preset in presets_of(case)}
