"""Every ``torchrun`` command in docs/ is run by a test exactly as written (issue 60).

The commands are read from the markdown's fenced code blocks (a line with ``torchrun``, joined
over trailing backslashes, its ``# comment`` dropped) and run by ``bash`` in a scratch folder
that links the repository's ``examples/`` and ``benchmarks/``, so what they write (``ckpt``,
``out``) lands there. ``RUNNERS`` maps each command to what checks it; a command in the docs
without a runner, or a runner whose command left the docs, fails the fast test below.

The resume recipe of docs/resilience.md is killed twice (SIGKILL of rank 0's worker, then of
rank 1's, each after a new checkpoint) and must finish with every step's loss equal to an
uninterrupted run's, bit for bit. The uninterrupted run is the main example under torchrun on
a data mesh, checked also to print its collectives, report on rank 0 alone, write its loss
curve and exit cleanly (what tests/dist/test_example_torchrun.py checked before it was folded in
here: the same launch, the same assertions).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def doc_commands() -> dict[str, str]:
    """``{command: doc file name}`` for every torchrun command in docs/*.md."""
    found = {}
    for doc in DOCS:
        for block in _FENCE.findall(doc.read_text()):
            lines = iter(block.splitlines())
            for line in lines:
                while line.rstrip().endswith("\\"):
                    line = line.rstrip()[:-1].rstrip() + " " + next(lines).strip()
                command = re.sub(r"\s+#.*$", "", line).strip()
                if re.search(r"(^|\s)torchrun\s", command):
                    found[command] = doc.name
    return found


def _scratch(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # torchrun of this interpreter's environment
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}


def _run(command: str, cwd: Path, timeout: float = 600) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}\n{out[-4000:]}"
    # a clean shutdown: no traceback, the process groups destroyed before exit
    assert "Traceback" not in out and "destroy_process_group" not in out, out[-4000:]
    return out


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _workers(root: int, script: str) -> list[int]:
    """The worker processes torchrun (a descendant of ``root``) started for ``script``: those whose
    parent runs the script's command line too (the agent)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in _children(pid):
            if script in _cmdline(child) and script in _cmdline(pid) and "torchrun" not in _cmdline(child):
                found.append(child)
            todo.append(child)
    return sorted(found)


def _committed(ckpt: Path) -> list[int]:
    return sorted(int(d.name.split("_")[-1]) for d in ckpt.glob("step_*") if (d / "COMMIT").exists())


def _losses(metrics: Path) -> dict[int, str]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: float.hex(r["loss"]) for r in records}  # a resumed attempt's later records win


KILLS = 2  # rank 0's worker, then rank 1's: each rank's death is resumed from once


def _resume_recipe(command: str, tmp_path: Path) -> None:
    steps, every = (int(re.search(rf"--{f} (\d+)", command).group(1)) for f in ("steps", "save-every"))
    restarts = int(re.search(r"--max-restarts=(\d+)", command).group(1))
    assert restarts >= KILLS and steps // every > KILLS, f"the recipe must leave room for {KILLS} kills"
    reference = _scratch(tmp_path / "reference")
    out = _run(f"torchrun --standalone --nproc-per-node=2 examples/train_gpt.py --mesh dp=2 --steps {steps}", reference)
    assert "sharding {'dp': 2}: collectives per step:" in out and "all_gather_into_tensor over dp" in out, out[-4000:]
    assert out.count("done: train loss") == 1, out[-4000:]  # rank 0 reports; rank 1 stays quiet
    assert (reference / "out" / "loss.png").stat().st_size > 0
    expected = _losses(reference / "out" / "metrics.jsonl")
    assert sorted(expected) == list(range(1, steps + 1))

    run = _scratch(tmp_path / "resumed")
    proc = subprocess.Popen(["bash", "-c", command], cwd=run, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    killed: list[int] = []
    newest_at_kill = 0  # each kill waits for a checkpoint newer than the last kill saw
    try:
        deadline = time.monotonic() + 900
        while len(killed) < 2 * KILLS:
            assert proc.poll() is None, (
                f"the run ended before kill {len(killed) // 2 + 1}:\n{proc.stdout.read()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"no progress to kill {len(killed) // 2 + 1}"
            workers = [w for w in _workers(proc.pid, "train_gpt.py") if w not in killed]
            committed = _committed(run / "ckpt")
            # a kill comes once a fresh attempt's workers committed a checkpoint of their own
            if len(workers) == 2 and committed and committed[-1] > newest_at_kill:
                newest_at_kill = committed[-1]
                victim = workers[len(killed) // 2 % 2]  # rank 0's or rank 1's worker, in turn
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
                killed.extend(w for w in workers if w != victim)  # its peer goes down with the attempt
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("resumed from") == KILLS, out[-4000:]  # each attempt after a kill resumed
    assert _committed(run / "ckpt")[-1] == steps
    assert _losses(run / "out" / "metrics.jsonl") == expected  # bit for bit, every step


def _finishes(expect: str, times: int, *also: str) -> Callable[[str, Path], None]:
    """The command exits cleanly, printing ``expect`` ``times`` times (rank 0 reports, the other
    ranks stay quiet) and each of ``also``."""

    def check(command: str, tmp_path: Path) -> None:
        out = _run(command, _scratch(tmp_path))
        assert out.count(expect) == times and all(text in out for text in also), out[-4000:]

    return check


def _needs_gpus(n: int) -> Callable[[str, Path], None]:
    def check(command: str, tmp_path: Path) -> None:
        import torch

        if torch.cuda.device_count() < n:
            pytest.skip(f"needs {n} GPUs")
        _run(command, _scratch(tmp_path))

    return check


RUNNERS: dict[str, Callable[[str, Path], None]] = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=5 "
    "examples/train_gpt.py --mesh dp=2 --checkpoint-dir ckpt --save-every 10 --steps 60": _resume_recipe,
    "torchrun --standalone --nproc-per-node=4 examples/train_gpt.py --mesh dp=2,tp=2 --steps 20": _finishes(
        "done: train loss", 1
    ),
    "torchrun --standalone --nproc-per-node=2 examples/resnet.py --mesh dp=2 --device cpu --width 4 --steps 6 "
    "--eval-every 3": _finishes("eval loss", 2, "mesh {'dp': 2}"),
    "torchrun --nproc-per-node=2 benchmarks/collectives.py --out collectives-h200.json": _needs_gpus(2),
}


def test_every_documented_torchrun_command_has_a_runner():
    documented = doc_commands()
    assert set(documented) == set(RUNNERS), (
        f"in docs without a runner: {sorted(set(documented) - set(RUNNERS))}; "
        f"runners whose command left the docs: {sorted(set(RUNNERS) - set(documented))}"
    )


@pytest.mark.torchrun
@pytest.mark.parametrize("command", sorted(RUNNERS), ids=lambda c: " ".join(c.split()[:6])[:60])
def test_the_documented_command_runs_as_written(command, tmp_path):
    RUNNERS[command](command, tmp_path)
