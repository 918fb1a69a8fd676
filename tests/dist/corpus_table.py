"""The op corpus's outcomes as the table in docs/sharding.md (written from a run, read back
by the test so that the docs cannot drift from what the corpus shows)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.dist import op_corpus

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sharding.md"
BEGIN, END = "<!-- op-corpus:begin -->", "<!-- op-corpus:end -->"
COLUMNS = ("dp", "fsdp", "tp")
MATCH = "✓"


def short(outcome: str) -> str:
    """An outcome as the table writes it: ``✓`` or the error's class."""
    return MATCH if outcome == "match" else outcome.removeprefix("error: ")


def _cell(outcomes: dict[int, str]) -> str:
    """One preset's outcomes on 2 and 4 ranks as a table cell."""
    texts = {world: short(o) for world, o in outcomes.items()}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return ", ".join(f"{world} ranks: {text}" for world, text in sorted(texts.items()))


def expected(cell: str | None, world: int) -> str | None:
    """What a table cell says for ``world`` ranks."""
    if cell is None or "ranks: " not in cell:
        return cell
    per_world = dict(part.split(" ranks: ") for part in cell.split(", "))
    return per_world.get(str(world))


def merge(results: dict[int, dict[str, dict[str, str]]]) -> dict[str, dict[str, str]]:
    """``{world: {case: {preset: outcome}}}`` -> ``{case: {preset: cell}}`` (a case may have
    run on some of the worlds only)."""
    table = {}
    for name in {n for by_case in results.values() for n in by_case}:
        runs = {w: by_case[name] for w, by_case in results.items() if name in by_case}
        presets = next(iter(runs.values()))
        table[name] = {p: _cell({w: by_preset[p] for w, by_preset in runs.items()}) for p in presets}
    return table


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _row(name: str, group: str, cells: dict[str, str]) -> str:
    return f"| `{_escape(name)}` | {group} | " + " | ".join(cells.get(p, "—") for p in COLUMNS) + " |"


def torch_version() -> str:
    return torch.__version__.split("+")[0]


def docs_torch_version() -> str | None:
    """The torch release the table in the docs was made with."""
    found = re.search(r"\(torch ([0-9.]+)\)", DOCS.read_text())
    return found.group(1) if found else None


def read_docs() -> dict[str, dict[str, str]]:
    text = DOCS.read_text()
    body = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    table = {}
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        fields = [f.strip().replace("\\|", "|") for f in re.split(r"(?<!\\)\|", line)[1:-1]]
        name = fields[0].strip("`")
        table[name] = {p: cell for p, cell in zip(COLUMNS, fields[2:]) if cell != "—"}
    return table


def write_docs(table: dict[str, dict[str, str]], *, full: bool) -> None:
    """Rewrites the table between the markers (all cases when ``full``, else the rows run)."""
    merged = {**({} if full else read_docs()), **table}
    rows = [_row(c.name, c.group, merged[c.name]) for c in op_corpus.CASES if c.name in merged]
    matched = sum(cell == MATCH for cells in merged.values() for cell in cells.values())
    total = sum(len(cells) for cells in merged.values())
    block = "\n".join(
        [
            BEGIN,
            f"{len(rows)} cases; {matched} of {total} (case, layout) entries match the unsharded step on "
            f"both 2 and 4 ranks; the rest raise the error named, before anything runs "
            f"(torch {torch_version()}).",
            "",
            "| case | group | data parallel | FSDP | tensor parallel |",
            "|---|---|---|---|---|",
            *rows,
            END,
        ]
    )
    text = DOCS.read_text()
    DOCS.write_text(text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :])
