"""Text for a ``Plan``: the ranking, the best candidate's figures and why it wins."""

from __future__ import annotations


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def reason(ranked: list) -> str:
    """Why the best candidate ranks first: where each axis runs, and its lead on the runner-up."""
    best = ranked[0]
    where = ", ".join(
        f"{c.axis}={c.size} on {c.level} ({gb(c.bytes_per_rank)}/rank, {ms(c.seconds)}"
        f"{'' if c.blocking else ', overlappable'})"
        for c in best.per_axis
        if c.size > 1
    )
    text = f"{best.describe()}: {where or 'no communication'}"
    other = next((c for c in ranked[1:] if c.axes != best.axes), None)
    if other is not None:
        text += (
            f"; {ms(other.step_s - best.step_s)} faster per step than the next mesh, {other.describe()} "
            f"({ms(other.exposed_s)} exposed vs {ms(best.exposed_s)})"
        )
    naive = next((c for c in ranked if c.axes == best.axes and c.strategy == "row-major"), None)
    if naive is not None and best.strategy == "packed":
        text += (
            f"; against row-major placement of the same mesh it moves {gb(best.cross_rack_bytes)} across racks "
            f"instead of {gb(naive.cross_rack_bytes)} and exposes {ms(best.exposed_s)} instead of {ms(naive.exposed_s)}"
        )
    return text


def candidate_text(c) -> list[str]:
    lines = [f"  mesh {c.describe()}"]
    for a in c.per_axis:
        if a.size > 1:
            lines.append(
                f"    {a.axis:>5} x{a.size:<6} spans {a.level:<8} {gb(a.bytes_per_rank):>12}/rank  {ms(a.seconds):>11}"
                f"  {'critical path' if a.blocking else 'overlappable'}"
            )
    levels = ", ".join(f"{name} {gb(b)}" for name, b in c.level_bytes.items())
    lines.append(f"    bytes per step by link level (whole cluster): {levels}")
    lines.append(f"    cross-rack bytes per step: {gb(c.cross_rack_bytes)}")
    compute = f"compute {ms(c.compute_s)}, " if c.compute_s is not None else ""
    lines.append(
        f"    communication {ms(c.comm_s)}, {compute}hidden by overlap {ms(c.hidden_s)}, exposed {ms(c.exposed_s)}"
    )
    return lines


def plan_text(plan, top: int) -> str:
    """The plan as text: the cluster, the best candidate, the ranking and the refused meshes."""
    lines = [f"cluster: {plan.topology!r}", "(model predictions, not measurements)", "", "best:"]
    lines += candidate_text(plan.best)
    lines += ["", f"why: {plan.reason}", "", f"ranking (top {top} of {len(plan.ranked)}, by predicted step time):"]
    for i, c in enumerate(plan.ranked[:top], 1):
        lines.append(
            f"  {i:>2}. {c.describe():<44} exposed {ms(c.exposed_s):>10}  step {ms(c.step_s):>10}  "
            f"cross-rack {gb(c.cross_rack_bytes):>12}"
        )
    best_naive = next((c for c in plan.ranked if c.axes == plan.best.axes and c.strategy == "row-major"), None)
    if best_naive is not None and best_naive is not plan.best:
        lines += ["", "the same mesh placed row-major (naive):"] + candidate_text(best_naive)
    if plan.refused:
        lines += ["", f"refused ({len(plan.refused)}):"]
        lines += [f"  {' x '.join(f'{a}={n}' for a, n in axes.items())}: {why}" for axes, why in plan.refused[:8]]
        if len(plan.refused) > 8:
            lines.append(f"  ... and {len(plan.refused) - 8} more")
    return "\n".join(lines)
