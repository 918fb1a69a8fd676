"""examples/resnet.py under torchrun with --mesh dp=2 (gloo): BatchNorm over the global
batch, periodic compile_eval on the mesh, a clean exit (issue 21)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_resnet_example_under_torchrun_with_a_data_mesh():
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29563",
        str(ROOT / "examples" / "resnet.py"), "--mesh", "dp=2", "--device", "cpu", "--backend", "eager",
        "--width", "4", "--image-size", "16", "--batch-size", "16", "--steps", "6", "--eval-every", "3",
        "--eval-size", "32",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "mesh {'dp': 2}" in out and out.count("eval loss") == 2  # rank 0 reports; rank 1 stays quiet
    assert "Traceback" not in out and "destroy_process_group" not in out
