"""SIGKILL at random points of saving: the last complete checkpoint always restores bit-exact."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fsg
from fsg._src import tree
from tests.checkpoint.crash_worker import state_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_saves_never_loses_the_last_checkpoint(tmp_path, mode):
    rng = random.Random(0)
    manager = fsg.checkpoint.CheckpointManager(tmp_path, max_to_keep=2)
    seen = set()
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoint.crash_worker", str(tmp_path), mode],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))  # somewhere inside a save: files, rename or marker
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = manager.latest()
        if latest is None:
            continue
        seen.add(latest)
        restored = manager.restore(latest, like=state_for(0))
        expected = state_for(latest)
        for a, b in zip(tree.flatten(restored)[0], tree.flatten(expected)[0]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dim() else torch.equal(a, b)
        # nothing partial is listed: every listed step restores
        for step in manager.all_steps():
            fsg.checkpoint.read_meta(manager.step_dir(step))
    assert len(seen) >= 3  # the kills landed at different points of the run
