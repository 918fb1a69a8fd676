"""A run saved at step k and restored in a fresh process continues with exactly the losses of
the uninterrupted run, dropout on (issue 21): the random keys, the step count and the
optimizer state all come back from the checkpoint, nothing from the process."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.resume.worker", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_run_restored_in_a_fresh_process_continues_bit_for_bit(tmp_path):
    uninterrupted = _run("5")
    first = _run("2", "--save", str(tmp_path / "ckpt"))
    rest = _run("3", "--restore", str(tmp_path / "ckpt"))
    assert first + rest == uninterrupted
    assert len(set(uninterrupted)) == 5  # the losses move: the check is not vacuous
