"""What is alive at a CUDA process's peak of allocated memory, from the allocator's own trace.

``record()`` starts the caching allocator's history (torch's ``_record_memory_history``, a
private API: benchmarks only, never the library); ``census(path)`` replays the recorded
allocations and frees, finds the moment the allocated bytes peaked, and writes the blocks
alive then, largest first, each with the innermost frames of the Python stack that allocated it
(the generated Inductor module's line names the buffer). ``benchmarks/gpt.py`` calls both
when ``FSG_MEMORY_PEAK=path`` is set: a profile of fsg beside the baseline, issue 63.
"""

from __future__ import annotations

from collections import Counter

import torch

MiB = 2**20


def record(max_entries: int = 400_000) -> None:
    # Python frames only: the C++ ones ("all") fill each block's stack with the allocator's own
    # frames and leave no room to say which generated line or library call allocated it
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)


def _where(frames: list[dict], depth: int = 3) -> str:
    python = [f for f in frames if f["filename"].endswith(".py")]
    # the generated Inductor module or fsg's own frame names the buffer; torch's library frames do not
    own = [
        f for f in python if "torch/" not in f["filename"] or "inductor" in f["filename"] or "/tmp/" in f["filename"]
    ]
    keep = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in own or python]
    return " < ".join(keep[:depth]) or (frames[0]["name"] if frames else "?")


def census(path: str, top: int = 40) -> str:
    """Writes the census to ``path`` and returns its first lines."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snap["device_traces"] for e in trace]
    alive: dict[int, dict] = {}
    total = best = 0
    best_alive: dict[int, dict] = {}
    best_index = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            alive[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_alive, best_index = total, dict(alive), i
        elif e["action"] == "free_completed" and e["addr"] in alive:
            total -= alive.pop(e["addr"])["size"]
    # the blocks allocated before the history began are not in the trace: the segments say what
    # was allocated at the end, the replay how much the traced part adds
    lines = [
        f"peak of the traced allocations: {best / MiB:.0f} MiB above what was allocated before recording "
        f"(event {best_index} of {len(events)}; torch.cuda.max_memory_allocated {torch.cuda.max_memory_allocated() / MiB:.0f} MiB)",
    ]
    by_site: Counter = Counter()
    count: Counter = Counter()
    for e in best_alive.values():
        site = _where(e.get("frames", []))
        by_site[site] += e["size"]
        count[site] += 1
    lines.append(f"\nalive at the peak, by allocation site ({len(best_alive)} blocks):")
    for site, size in by_site.most_common(top):
        lines.append(f"{size / MiB:10.1f} MiB {count[site]:5d} x  {site}")
    lines.append("\nlargest blocks alive at the peak:")
    for e in sorted(best_alive.values(), key=lambda e: -e["size"])[:top]:
        lines.append(f"{e['size'] / MiB:10.1f} MiB  {_where(e.get('frames', []), 5)}")
    text = "\n".join(lines)
    with open(path, "w") as f:
        f.write(text + "\n")
    return "\n".join(lines[:12])
