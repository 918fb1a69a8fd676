"""CheckpointManager's edges: reads wait for a save in flight, exit flushes a pending save, and a
checkpoint without its commit marker is never listed nor restored."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fsg
from fsg._src.checkpoint import _io, _manager
from tests.checkpoint import exit_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def slow_writes(monkeypatch):
    """Background writes take 0.3 s more, so that reads right after ``save`` find them in flight."""
    write = _manager._checkpoint.write

    def slow(*args, **kwargs):
        time.sleep(0.3)
        write(*args, **kwargs)

    monkeypatch.setattr(_manager._checkpoint, "write", slow)


def saved_in_flight(tmp_path, step=3):
    m = fsg.checkpoint.CheckpointManager(tmp_path, async_save=True)
    state = {"w": torch.arange(4.0), "n": torch.tensor(step)}
    assert m.save(step, state)
    assert m._thread is not None and m._thread.is_alive()  # the write is still going on
    return m, state


@pytest.mark.parametrize("read", ["latest", "all_steps", "restore", "restore_or_init"])
def test_reads_wait_for_a_save_in_flight(tmp_path, slow_writes, read):
    m, state = saved_in_flight(tmp_path)
    like = {"w": torch.zeros(4), "n": torch.tensor(0)}
    if read == "latest":
        assert m.latest() == 3
    elif read == "all_steps":
        assert m.all_steps() == [3]
    elif read == "restore":
        restored = m.restore(3, like=like)
        assert torch.equal(restored["w"], state["w"]) and int(restored["n"]) == 3
    else:
        restored = m.restore_or_init(lambda: like)
        assert torch.equal(restored["w"], state["w"]) and int(restored["n"]) == 3
    assert m._thread is None


def test_a_failed_save_in_flight_is_raised_by_the_read_that_waits(tmp_path, slow_writes):
    m, state = saved_in_flight(tmp_path)
    m.wait()
    m.save(3, state, force=True)  # the same step again: the background write refuses
    with pytest.raises(fsg.CheckpointError, match="background checkpoint save failed: .*already exists"):
        m.latest()
    assert m.latest() == 3  # reported once; the earlier checkpoint stands


def test_exit_flushes_a_pending_async_save(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint.exit_worker", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "saved"
    m = fsg.checkpoint.CheckpointManager(tmp_path)
    assert m.latest() == 7
    assert _io.is_committed(m.step_dir(7))
    want = exit_worker.state()
    restored = m.restore(7, like={"w": torch.zeros(256, 256), "step": torch.tensor(0)})
    assert torch.equal(restored["w"], want["w"]) and int(restored["step"]) == 7


def test_a_checkpoint_without_its_commit_marker_is_never_restored(tmp_path):
    m = fsg.checkpoint.CheckpointManager(tmp_path, async_save=False)
    like = {"w": torch.zeros(2)}
    m.save(1, {"w": torch.ones(2)})
    m.save(2, {"w": torch.full((2,), 2.0)})
    (m.step_dir(2) / _io.COMMIT).unlink()  # as if the save died before its marker
    assert m.all_steps() == [1] and m.latest() == 1
    assert torch.equal(m.restore_or_init(lambda: like)["w"], torch.ones(2))  # the earlier one
    with pytest.raises(fsg.CheckpointError, match=r"step_00000002 is incomplete \(no COMMIT marker"):
        m.restore(2, like=like)
    with pytest.raises(fsg.CheckpointError, match="is incomplete"):
        fsg.checkpoint.restore(m.step_dir(2), like=like)
    m.save(2, {"w": torch.full((2,), 3.0)})  # the step can be saved again: the stale directory is replaced
    assert m.latest() == 2 and torch.equal(m.restore(2, like=like)["w"], torch.full((2,), 3.0))
