"""Checkpoint throughput: fsg.checkpoint beside torch.save and torch.distributed.checkpoint.

    python benchmarks/checkpoint.py --params 50e6            # CPU state
    python benchmarks/checkpoint.py --params 124e6 --device cuda

The state is a GPT-2-like parameter dict plus AdamW state (fsg.optim.adamw().init), i.e.
3x the parameter bytes in float32. Each row is the median of --repeats runs into fresh
directories on the same disk. Save times include fsync for fsg (its atomic commit requires
it); torch.save and DCP are timed as they come (no fsync), so fsg's number is the more
conservative one. Restores right after a save read from the page cache unless
--drop-caches works on this machine. "blocked" is how long the training loop waits in an
asynchronous save (fsg CheckpointManager.save; dcp.async_save).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import fsg

GPT2_SHAPES = [(50304, 768), (1024, 768)] + [
    shape for _ in range(12) for shape in [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,),
                                           (3072, 768), (3072,), (768, 3072), (768,)]
] + [(768,), (768,)]  # fmt: skip


def make_state(n_params: float, device: str) -> fsg.TrainState:
    scale = (n_params / sum(torch.Size(s).numel() for s in GPT2_SHAPES)) ** 0.5
    g = torch.Generator().manual_seed(0)
    params = {}
    for i, shape in enumerate(GPT2_SHAPES):
        shape = tuple(max(1, round(d * scale)) if len(shape) == 2 and j == 0 else d for j, d in enumerate(shape))
        params[f"p{i:03d}"] = torch.randn(shape, generator=g).to(device)
    step = fsg.compile_step(lambda p, b: p["p000"].sum(), optimizer=fsg.optim.adamw(1e-3))
    state = step.init(params)
    for leaf in fsg._src.tree.flatten(state.opt_state)[0]:
        if leaf.is_floating_point():
            leaf.normal_()  # real bytes, not zeros
    return state


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in fsg._src.tree.flatten(state)[0])


def flat_dict(state) -> dict[str, torch.Tensor]:
    leaves, _ = fsg._src.tree.flatten(state)
    return {path: leaf for path, leaf in zip(fsg._src.tree.leaf_paths(state, "state"), leaves)}


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="fsg-ckpt-bench-"))
    state = make_state(args.params, args.device)
    size = nbytes(state)
    dropped = drop_caches()
    print(f"fsg {fsg.__version__}, torch {torch.__version__}, {platform.machine()}, device {args.device}; "
          f"state {size / 1e9:.2f} GB ({args.params / 1e6:.0f}M params + AdamW); page cache dropped before "
          f"restores: {dropped}")  # fmt: skip
    results: dict[str, list[float]] = {}

    def record(name, seconds):
        results.setdefault(name, []).append(seconds)

    like = make_state(args.params, args.device)
    for r in range(args.repeats):
        d = root / f"run{r}"
        d.mkdir(parents=True)
        # fsg, synchronous (fsync + atomic commit)
        record("fsg save", timed(lambda: fsg.checkpoint.save(d / "fsg", state), args.device))
        drop_caches()
        record("fsg restore", timed(lambda: fsg.checkpoint.restore(d / "fsg", like=like), args.device))
        # torch.save / torch.load of the same tensors
        sd = flat_dict(state)
        record("torch.save", timed(lambda: torch.save(sd, d / "torch.pt"), args.device))

        def save_and_fsync():
            with open(d / "torch2.pt", "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())

        record("torch.save + fsync", timed(save_and_fsync, args.device))
        drop_caches()
        record("torch.load", timed(lambda: torch.load(d / "torch.pt", map_location=args.device), args.device))
        # torch.distributed.checkpoint (no process group: single process)
        record("dcp.save", timed(lambda: dcp.save(sd, checkpoint_id=d / "dcp"), args.device))
        drop_caches()
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        record("dcp.load", timed(lambda: dcp.load(target, checkpoint_id=d / "dcp"), args.device))
        # asynchronous: time the training loop is blocked
        m = fsg.checkpoint.CheckpointManager(d / "mgr", async_save=True)
        record("fsg async (blocked)", timed(lambda: m.save(1, state), args.device))
        t0 = time.perf_counter()
        m.wait()
        record("fsg async (background)", time.perf_counter() - t0)
        try:
            fut = None

            def start():
                nonlocal fut
                fut = dcp.async_save(sd, checkpoint_id=d / "dcp_async")

            record("dcp.async_save (blocked)", timed(start, args.device))
            fut.result()
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            results.setdefault("dcp.async_save (blocked)", [])
            print(f"dcp.async_save failed here: {type(exc).__name__}: {exc}")
        shutil.rmtree(d)
    print()
    print("| operation | median time (s) | throughput (GB/s) |")
    print("|---|---|---|")
    for name, times in results.items():
        if not times:
            print(f"| {name} | failed | |")
            continue
        t = statistics.median(times)
        print(f"| {name} | {t:.3f} | {size / t / 1e9:.2f} |")


if __name__ == "__main__":
    main()
