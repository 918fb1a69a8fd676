"""An FSDP step's graph as CUDA builds it (skipped without a GPU): the CUDA-only rewrites must
not undo FSDP's packed gathers (both bugs of 2026-12-04 showed only there or at real widths:
the batched casts took every gather out of its bucket; a whole-extent slice kept the qkv and fc
weights on bf16 gathers under ``Float8(all_gather="fp8")``). One process posing as rank 0 of 2
(torch's fake process group, ``mesh_graph_script.py``); the graph is lowered, not run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_fsdp_gathers_stay_packed_on_cuda_with_the_cuda_rewrites():
    script = Path(__file__).with_name("mesh_graph_script.py")
    root = Path(__file__).resolve().parents[2]
    # the repository root on the path: the script imports fsg from a checkout that is not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=root, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][7:])
    bf16, fp8 = out["bf16"], out["fp8-gather"]
    gathers = "all_gather_into_tensor.default"
    assert bf16["collectives"][f"{gathers}:torch.bfloat16"] == 1, bf16  # one bucket at these sizes
    assert fp8["collectives"][f"{gathers}:torch.uint8"] == 1, fp8  # the FP8 weights' bucket
    assert fp8["collectives"][f"{gathers}:torch.bfloat16"] == 1, fp8  # biases, norms, embeddings
    assert "8 weights gathered in FP8" in out["said"], out["said"]  # qkv, proj, fc, fc_proj of 2 layers
