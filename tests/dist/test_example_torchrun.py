"""The main example runs sharded under torchrun (2 gloo ranks) and exits cleanly."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_gpt_under_torchrun_with_a_mesh(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29561",
        str(ROOT / "examples" / "train_gpt.py"), "--mesh", "dp=2", "--device", "cpu", "--steps", "40", "--backend", "eager",
        "--eval-every", "40", "--sample-every", "40", "--n-layer", "2", "--n-embd", "64", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "sharding {'dp': 2}: collectives per step:" in out and "all_gather_into_tensor over dp" in out
    assert out.count("done: train loss") == 1  # rank 0 reports; rank 1 stays quiet
    assert (tmp_path / "loss.png").exists()
    # a clean shutdown: the process groups are destroyed before exit
    assert "destroy_process_group" not in out and "Traceback" not in out
