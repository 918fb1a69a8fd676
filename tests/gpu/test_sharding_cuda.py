"""Each sharding preset's GPT step equals the one-device step on CUDA (skipped without a GPU):
the ranks share GPU 0 and meet over gloo (``MultiRank(device="cuda")``), so one GPU checks the CUDA code of a
mesh (Inductor's GPU kernels, fsg's Triton kernels, the passes' placement around collectives).
The presets that all-gather (FSDP, TP) run only where torch's functional all-gather works on
gloo with CUDA tensors (it segfaulted on torch 2.11: ``gloo_cuda_all_gather.py``).
Such a check, on two GPUs over NCCL, found that the data-parallel step's layer-norm gradients
were uninitialized memory (``backend/column_sums.py``); CPU tests cannot see GPU codegen. Each
rank holds 8,192 rows of width 768, so Inductor fuses the layer norms' backward as it does for
GPT-2 124M."""

import functools
import math
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

import fsg
import fsg.testing
from tests.dist.workers import preset_rules

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MESHES = {"dp": {"dp": 2}, "fsdp": {"dp": 2}, "tp": {"tp": 2}, "fsdp_tp": {"dp": 2, "tp": 2}}  # rules: preset_rules


def _matches_one_device(preset: str) -> None:
    from examples.gpt import GPT, GPTConfig

    axes = MESHES[preset]
    dev = torch.device("cuda", 0)  # the pool set it: MultiRank(device="cuda")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=1024, n_layer=2, n_head=12, n_embd=768)).to(dev)
    rows = 8 * axes.get("dp", 1)
    data = torch.randint(0, 512, (2, rows, 1025), generator=torch.Generator().manual_seed(0))
    batches = [{"x": d[:, :-1].to(dev), "y": d[:, 1:].to(dev)} for d in data]
    fsg.testing.assert_sharded_matches_unsharded(
        lambda params, batch: fsg.apply(model, params, batch["x"], batch["y"]),
        fsg.params(model), batches, fsg.testing.mesh(axes, device_type="cuda"),
        optimizer=fsg.optim.adamw(6e-4, eps=1e-3, weight_decay=0.1),  # eps: see benchmarks/dp.py's check
        param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp") if "dp" in axes else fsg.P(), rtol=1e-4, atol=1e-5, backend="inductor",
    )  # fmt: skip


@functools.cache
def _gloo_gathers_cuda_tensors() -> bool:
    """Whether torch's functional all-gather works on gloo with CUDA tensors (plain torch, in
    a subprocess: gloo_cuda_all_gather.py, which segfaulted on torch 2.11)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = pathlib.Path(__file__).with_name("gloo_cuda_all_gather.py")
    return subprocess.run([sys.executable, str(script), str(port)], capture_output=True, timeout=120).returncode == 0


@pytest.mark.parametrize("preset", sorted(MESHES))
def test_a_sharded_gpt_step_equals_one_device_on_cuda(preset):
    if preset != "dp" and not _gloo_gathers_cuda_tensors():
        pytest.skip(
            f"torch {torch.__version__}: _c10d_functional.all_gather_into_tensor on gloo with CUDA tensors "
            "crashes without fsg (tests/gpu/gloo_cuda_all_gather.py); FSDP and TP on CUDA are checked over "
            "NCCL on two GPUs (benchmarks/dp.py --check)"
        )
    with fsg.testing.MultiRank(math.prod(MESHES[preset].values()), timeout=900, device="cuda") as ranks:
        ranks.run(_matches_one_device, preset)
