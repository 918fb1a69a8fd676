"""A schedule's timeline as a picture: one row per rank, a box per action (matplotlib)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsg._src.errors import UnsupportedError

if TYPE_CHECKING:
    from fsg._src.pipeline.simulate import Timeline

COLOURS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B"}
NAMES = {"F": "forward", "B": "input gradient", "W": "weight gradient"}


def draw(timeline: Timeline, path: str, *, title: str | None = None) -> None:
    """Writes ``timeline`` as a PNG at ``path`` (rank 0 on top; labels: microbatch, and the
    stage where a rank holds several)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise UnsupportedError(
            "drawing a pipeline timeline needs matplotlib, which is not installed: pip install matplotlib"
        ) from exc
    schedule = timeline.schedule
    span = timeline.makespan or 1.0
    origin = min((e.start for rank in timeline.events for e in rank), default=0.0)
    fig, ax = plt.subplots(figsize=(min(16.0, 2.0 + 0.25 * len(timeline.events[0])), 0.5 + 0.45 * schedule.pp))
    for rank, events in enumerate(timeline.events):
        y = schedule.pp - 1 - rank
        for e in events:
            box = [(e.start - origin, e.end - e.start)]
            ax.broken_barh(box, (y + 0.05, 0.9), facecolors=COLOURS[e.action.kind], edgecolor="white", linewidth=0.5)
            label = str(e.action.microbatch) if schedule.virtual == 1 else f"{e.action.microbatch}/{e.action.stage}"
            ax.text(
                e.start - origin + (e.end - e.start) / 2,
                y + 0.5,
                label,
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks([schedule.pp - 1 - r + 0.5 for r in range(schedule.pp)], [f"rank {r}" for r in range(schedule.pp)])
    ax.set_xlim(0, span)
    ax.set_ylim(0, schedule.pp)
    name = title or f"{schedule.name}: pp={schedule.pp}, v={schedule.virtual}, {schedule.num_microbatches} microbatches"
    ax.set_title(f"{name}; bubble {timeline.bubble:.1%} (x: time)", fontsize=9)
    handles = [Patch(color=c, label=NAMES[k]) for k, c in COLOURS.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=6, bbox_to_anchor=(1.0, -0.2), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
