"""The OpInfo corpus's outcomes as the table in docs/sharding.md, written from a run.

``python -m tests.corpus.opinfo_table`` runs the corpus as CI does (every case on one device
under ``aot_eager``, Inductor's sample, the mesh's sample of trusted cases on 2 gloo ranks) and
rewrites the table between the markers. The corpus tests read its counts back, so the docs
cannot drift from what the corpus shows.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import torch

from tests.corpus import opinfo, opinfo_expected

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sharding.md"
BEGIN, END = "<!-- opinfo-corpus:begin -->", "<!-- opinfo-corpus:end -->"
RUNNERS = {
    "aot_eager": "one device, `aot_eager`",
    "inductor": "one device, Inductor",
    "dp": "data parallel, 2 ranks",
    "fsdp": "FSDP, 2 ranks",
}


def counts(results: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    """``{outcome: {runner: number of cases}}``."""
    table: dict[str, dict[str, int]] = collections.defaultdict(lambda: dict.fromkeys(RUNNERS, 0))
    for by_runner in results.values():
        for runner, outcome in by_runner.items():
            table[outcome][runner] += 1
    return {outcome: dict(by_runner) for outcome, by_runner in table.items()}


def _order(outcome: str) -> tuple:
    return outcome != "match", not outcome.startswith("random"), outcome


def render(results: dict[str, dict[str, str]], inventory: opinfo.Inventory) -> str:
    """The docs block (between the markers) for ``results``."""
    table = counts(results)
    n_ops = len({case.op_name for case in inventory.cases})
    zero_d = sum(case.name.endswith("[0-d]") for case in inventory.cases)
    lines = [
        BEGIN,
        f"{len(opinfo.selected_ops())} ops of `op_db` have float64 gradients on the CPU (torch {torch_version()}); "
        f"{len(inventory.torch_skipped)} of them torch's own OpInfo skips or expects to fail in its gradient or "
        f"eager-consistency tests (not run, listed below), {len(inventory.unusable)} have no sample eager can train, "
        f"and the other {n_ops} make {len(inventory.cases)} cases ({zero_d} of them a 0-d sample). Cases per "
        f"outcome, each trained 2 SGD steps and compared with `torch.optim.SGD` (float64, rtol 1e-9):",
        "",
        "| outcome | " + " | ".join(RUNNERS.values()) + " |",
        "|---|" + "---|" * len(RUNNERS),
        *(
            f"| {outcome} | " + " | ".join(str(table[outcome][r]) for r in RUNNERS) + " |"
            for outcome in sorted(table, key=_order)
        ),
        "",
        "The cases that do not match, and why (`tests/corpus/opinfo_expected.py`; — : not run there):",
        "",
        "| case | " + " | ".join(RUNNERS) + " | why |",
        "|---|" + "---|" * (len(RUNNERS) + 1),
    ]
    for name in sorted(n for n, by_runner in results.items() if set(by_runner.values()) != {"match"}):
        cells = [results[name].get(r, "—").removeprefix("error: ") for r in RUNNERS]
        why = opinfo_expected.EXPECTED[name].reason if name in opinfo_expected.EXPECTED else "(not listed)"
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {why} |")
    by_test = collections.defaultdict(list)
    for op, test in sorted(inventory.torch_skipped.items()):
        by_test[test].append(f"`{op}`")
    lines += ["", "Skipped as torch's OpInfo skips them for float64 on the CPU:", ""]
    lines += [f"- `{test}`: {', '.join(ops)}" for test, ops in sorted(by_test.items())]
    if inventory.unusable:
        lines += [f"- no trainable sample: {', '.join(f'`{op}`' for op in inventory.unusable)}"]
    return "\n".join([*lines, END])


def torch_version() -> str:
    return torch.__version__.split("+")[0]


def docs_block() -> str:
    text = DOCS.read_text()
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def read_counts() -> dict[str, dict[str, int]]:
    """The outcome table in the docs, as ``counts`` returns it."""
    table = {}
    for line in docs_block().splitlines():
        fields = [f.strip() for f in line.strip("|").split("|")]
        if len(fields) == len(RUNNERS) + 1 and all(re.fullmatch(r"\d+", f) for f in fields[1:]):
            table[fields[0]] = dict(zip(RUNNERS, map(int, fields[1:])))
    return table


def docs_torch_version() -> str | None:
    found = re.search(r"\(torch ([0-9.]+)\)", docs_block())
    return found.group(1) if found else None


def drift(results: dict[str, dict[str, str]], runners: tuple[str, ...]) -> list[str]:
    """Where the docs' counts for ``runners`` differ from ``results``' (nothing when the docs
    were made with another torch release)."""
    if docs_torch_version() != torch_version():
        return []
    fresh, documented = counts(results), read_counts()
    outcomes = sorted(set(fresh) | set(documented))
    return [
        f"{outcome} under {runner}: {fresh.get(outcome, {}).get(runner, 0)} cases, the docs say "
        f"{documented.get(outcome, {}).get(runner, 0)}"
        for outcome in outcomes
        for runner in runners
        if fresh.get(outcome, {}).get(runner, 0) != documented.get(outcome, {}).get(runner, 0)
    ]


def write_docs(block: str) -> None:
    text = DOCS.read_text()
    if BEGIN not in text:
        raise SystemExit(f"{DOCS} has no {BEGIN} marker: add the subsection first")
    DOCS.write_text(text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :])


def main() -> None:
    import fsg.testing
    from tests.corpus import opinfo_run
    from tests.dist import opinfo_workers

    inventory = opinfo.inventory()
    results = opinfo_run.one_device(inventory.cases)
    with fsg.testing.MultiRank(opinfo_workers.WORLD, timeout=1200) as ranks:
        for name, by_preset in opinfo_workers.run_on(ranks, opinfo_workers.mesh_cases(inventory.cases)).items():
            results[name].update(by_preset)
    for problem in opinfo_expected.problems(results):
        print(problem)
    write_docs(render(results, inventory))
    print(f"wrote the OpInfo corpus table of {DOCS}")


if __name__ == "__main__":
    main()
