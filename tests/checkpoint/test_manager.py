"""CheckpointManager: intervals, pruning, async saves and their errors, resumable scripts."""

import pytest
import torch

import fsg


@pytest.mark.parametrize("async_save", [True, False])
def test_interval_pruning_latest_and_restore(tmp_path, async_save):
    m = fsg.checkpoint.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=5, async_save=async_save)
    state = {"w": torch.zeros(4), "n": torch.tensor(0)}
    saved = []
    for step in range(23):
        state["w"] += 1  # updated in place after save() returns: the snapshot must not see it
        state["n"] += 1
        if m.save(step, state):
            saved.append((step, state["w"].clone()))
    m.wait()
    assert [s for s, _ in saved] == [0, 5, 10, 15, 20]
    assert m.all_steps() == [15, 20] and m.latest() == 20
    restored = m.restore(20, like=state)
    assert torch.equal(restored["w"], saved[-1][1]) and int(restored["n"]) == 21


def test_background_error_surfaces_at_the_next_call(tmp_path):
    m = fsg.checkpoint.CheckpointManager(tmp_path)
    state = {"w": torch.ones(2)}
    m.save(1, state)
    m.wait()
    m.save(1, state, force=True)  # same step again: the background write refuses to overwrite
    with pytest.raises(fsg.CheckpointError, match="background checkpoint save failed: .*already exists"):
        m.save(2, state)
    assert m.save(2, state)  # the error was reported once; the manager goes on
    m.wait()
    assert m.all_steps() == [1, 2]


def test_restore_or_init_resumes(tmp_path):
    def init():
        return {"w": torch.zeros(3), "step": torch.tensor(0)}

    m = fsg.checkpoint.CheckpointManager(tmp_path)
    state = m.restore_or_init(init)
    assert int(state["step"]) == 0
    state["step"] += 7
    state["w"] += 2
    m.save(7, state)
    m.wait()
    resumed = fsg.checkpoint.CheckpointManager(tmp_path).restore_or_init(init)
    assert int(resumed["step"]) == 7 and torch.equal(resumed["w"], torch.full((3,), 2.0))


def test_incomplete_checkpoints_are_not_listed(tmp_path):
    m = fsg.checkpoint.CheckpointManager(tmp_path, async_save=False)
    m.save(1, {"w": torch.ones(2)})
    (tmp_path / "step_00000002.tmp").mkdir()  # a save that crashed before its rename
    (tmp_path / "step_00000003").mkdir()  # one that crashed before its commit marker
    assert m.all_steps() == [1] and m.latest() == 1
    m.save(4, {"w": torch.ones(2)})
    assert not (tmp_path / "step_00000002.tmp").exists()  # stale temporary cleaned up
