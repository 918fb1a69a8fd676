"""The OpInfo corpus's cases that do not match eager, each with the outcome expected and why.

A case absent here must match eager (``"match"``). An entry maps a case name (the OpInfo's
full name, ``[0-d]`` for its 0-d sample) to ``{runner: outcome}`` (runners: ``"aot_eager"``,
``"inductor"``, ``"dp"``, ``"fsdp"``; ``"*"`` for all of them) and the reason. The corpus test
fails on an outcome that differs from its entry, and on an entry whose case matched (stale).
"""

from __future__ import annotations

from typing import NamedTuple


class Expected(NamedTuple):
    outcomes: dict[str, str]  # {runner or "*": outcome}
    reason: str


_RANDOM = "draws random numbers: fsg's come from state.rng, eager's from torch's global generator"
_BUFFERS = (
    "training-mode batch norm writes the running statistics OpInfo passes as plain tensors, "
    "constants of loss_fn: fsg refuses the write (put buffers in the state: docs/models.md#buffers)"
)
_SHAPE = "output shape depends on the data; a static graph cannot hold it"

EXPECTED: dict[str, Expected] = {
    "bernoulli": Expected({"*": "random: reproducible"}, _RANDOM),
    "bernoulli[0-d]": Expected({"*": "random: reproducible"}, _RANDOM),
    "nn.functional.rrelu": Expected({"*": "random: reproducible"}, _RANDOM),
    "nn.functional.rrelu[0-d]": Expected({"*": "random: reproducible"}, _RANDOM),
    "nn.functional.multi_head_attention_forward": Expected(
        {"*": "random: reproducible"}, "its sample trains with dropout_p=0.5: " + _RANDOM
    ),
    "native_batch_norm": Expected({"*": "error: ImpureLossError"}, _BUFFERS),
    "_native_batch_norm_legit": Expected({"*": "error: ImpureLossError"}, _BUFFERS),
    "_batch_norm_with_update": Expected({"*": "error: ImpureLossError"}, _BUFFERS),
    "nn.functional.batch_norm": Expected({"*": "error: ImpureLossError"}, _BUFFERS),
    "nn.functional.instance_norm": Expected({"*": "error: ImpureLossError"}, _BUFFERS),
    "masked_select": Expected({"*": "error: UnsupportedError"}, "masked_select's " + _SHAPE),
    "masked_select[0-d]": Expected({"*": "error: UnsupportedError"}, "masked_select's " + _SHAPE),
    "combinations": Expected({"*": "error: UnsupportedError"}, "it selects with masked_select, whose " + _SHAPE),
    "nn.functional.ctc_loss": Expected({"*": "error: UnsupportedError"}, "aten._ctc_loss's " + _SHAPE),
    "linalg.lstsq.grad_oriented": Expected({"*": "error: UnsupportedError"}, "linalg_lstsq's " + _SHAPE),
    "corrcoef": Expected(
        {"*": "error: HostSyncError"},
        "torch's cov (inside corrcoef) reads its degrees of freedom on the host to warn when they are <= 0",
    ),
}


def expected(name: str, runner: str) -> str:
    """The outcome expected of case ``name`` under ``runner``."""
    entry = EXPECTED.get(name)
    if entry is None:
        return "match"
    return entry.outcomes.get(runner, entry.outcomes.get("*", "match"))


def problems(results: dict[str, dict[str, str]]) -> list[str]:
    """What in ``{case: {runner: outcome}}`` breaks the corpus's rule: a silent mismatch, a
    failure that is not an ``fsg.FsgError``, an outcome other than the one listed here, or an
    entry listed here for a runner that matched (stale: remove it)."""
    found = []
    for name, by_runner in sorted(results.items()):
        for runner, outcome in by_runner.items():
            want = expected(name, runner)
            if outcome.startswith("MISMATCH"):
                found.append(f"{name} under {runner}: silently different from eager: {outcome}")
            elif outcome.startswith("crash"):
                found.append(f"{name} under {runner}: not a clear fsg error: {outcome}")
            elif outcome != want:
                stale = " (stale entry in tests/corpus/opinfo_expected.py)" if outcome == "match" else ""
                found.append(f"{name} under {runner}: {outcome}, expected {want}{stale}")
    return found
