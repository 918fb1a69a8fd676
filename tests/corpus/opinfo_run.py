"""One OpInfo case trained through ``fsg.compile_step`` and compared with eager ``torch.optim``.

An outcome is ``"match"`` (every trained parameter and each step's loss equal eager's within
float64 tolerance), ``"error: <FsgError subclass>"`` (a clear refusal), ``"MISMATCH ..."``
(a silently different result: what the corpus exists to catch) or ``"crash: ..."`` (an
exception that is not an ``fsg.FsgError``: not a clear error either).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

import fsg
from tests.corpus import opinfo

RTOL, ATOL = 1e-9, 1e-11


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(_local(got), want, rtol=RTOL, atol=ATOL, equal_nan=True)


def compare(params: dict, losses: list, reference: tuple[dict, list]) -> str:
    """``"match"`` or ``"MISMATCH <the first difference>"``."""
    ref_params, ref_losses = reference
    for i, (got, want) in enumerate(zip(losses, ref_losses)):
        if not _close(got, want):
            return f"MISMATCH loss of step {i + 1}: {_local(got).item():.12g} vs eager {want.item():.12g}"
    for name in sorted(ref_params):
        got, want = _local(params[name]), ref_params[name]
        if not _close(got, want):
            return f"MISMATCH params[{name!r}] ({list(want.shape)}) off by {(got - want).abs().max().item():.2e}"
    return "match"


def outcome_of(exc: Exception) -> str:
    if isinstance(exc, fsg.FsgError):
        return f"error: {type(exc).__name__}"
    text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return f"crash: {type(exc).__name__}: {text}"


def train(
    case: opinfo.Case,
    make_step: Callable[[Callable], Any],
    batch: dict | None = None,
    loss_fn: Callable | None = None,
) -> tuple[dict, list] | str:
    """``opinfo.STEPS`` steps of ``make_step(loss_fn)``: ``(params, losses)``, or the outcome
    of the exception it raised."""
    try:
        step = make_step(loss_fn or case.loss_fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fsg.ShardingFallbackWarning)  # gathered, still exact
            state = step.init(case.params)
            losses = []
            for _ in range(opinfo.STEPS):
                state, metrics = step(state, batch or {})
                losses.append(metrics["loss"])
    except Exception as exc:  # noqa: BLE001 - reported as an outcome, never hidden
        return outcome_of(exc)
    return dict(state.params), losses


def run(case: opinfo.Case, backend: str) -> str:
    """The case on one device under ``backend``, against eager ``torch.optim.SGD``. A random
    op's draws come from ``state.rng``, not torch's generator: where they change the result
    it is checked to train the same twice from one seed (``"random: reproducible"``)."""

    def make_step(loss_fn: Callable) -> Any:
        return fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(opinfo.LR), backend=backend)

    step = make_step(case.loss_fn)
    trained = train(case, lambda _: step)
    if isinstance(trained, str):
        return trained
    outcome = compare(*trained, opinfo.train_eager(case))
    if outcome == "match" or not case.random:
        return outcome
    again = train(case, lambda _: step)
    same = again if isinstance(again, str) else compare(*again, trained)
    return "random: reproducible" if same == "match" else f"{same} (random: the same seed trained differently)"


def one_device(cases: list[opinfo.Case]) -> dict[str, dict[str, str]]:
    """``{case: {"aot_eager": outcome, "inductor": outcome}}``, Inductor for its sample only."""
    results = {}
    for case in cases:
        results[case.name] = {"aot_eager": run(case, "aot_eager")}
        if opinfo.in_inductor_sample(case.name):
            results[case.name]["inductor"] = run(case, "inductor")
    return results
