"""Calibrates fsg's collective cost model: times all-reduce, all-gather, reduce-scatter and
all-to-all from 4 KiB to 2 GiB and writes a JSON that ``fsg.topology.CostModel.load`` reads.

    torchrun --nproc-per-node=2 benchmarks/collectives.py --out collectives-h200.json   # NCCL
    torchrun --nproc-per-node=2 benchmarks/collectives.py --backend gloo --max-bytes 4MiB   # CPU smoke test

Each size is timed over ``--iters`` runs after ``--warmup`` (CUDA events on GPU, a barrier and
``perf_counter`` on CPU); the median is kept. ``size`` is the full buffer (the all-reduced
buffer, the all-gather output, the reduce-scatter input), and bus bandwidth is nccl-tests':
``factor * size / time`` with ``factor`` ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` otherwise.
The JSON also lists the model's prediction next to each measurement (``predicted_us``, from
the fitted floor and bandwidth), so the 15% target at >= 64 MiB can be checked from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from fsg._src.topology.cost import CostModel, KindCost, bus_factor, fit
from fsg._src.topology.levels import Link

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def parse_bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def run(kind: str, size: int, n: int, device: torch.device, dtype: torch.dtype):
    numel = size // torch.tensor([], dtype=dtype).element_size()
    numel -= numel % n
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // n, dtype=dtype, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full)


def time_us(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    samples = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)  # the slowest rank decides
    return float(samples.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None, help="nccl (default on GPU) or gloo")
    ap.add_argument("--min-bytes", type=parse_bytes, default=4 << 10)
    ap.add_argument("--max-bytes", type=parse_bytes, default=2 << 30)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="collectives.json")
    args = ap.parse_args()
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    samples = []
    for kind in args.kinds.split(","):
        size = args.min_bytes
        while size <= args.max_bytes:
            t = time_us(run(kind, size, n, device, dtype), device, args.warmup, args.iters)
            samples.append({"kind": kind, "bytes": size, "time_us": t,
                            "busbw_GBps": bus_factor(kind, n) * size / t * 1e-3})  # fmt: skip
            if rank == 0:
                print(f"{kind:>15} {size:>12} B {t:>12.1f} us  busbw {samples[-1]['busbw_GBps']:8.2f} GB/s", flush=True)
            size *= 2
    table = fit(samples, n)
    model = CostModel({k: KindCost(v["floor_us"], v["busbw_GBps"]) for k, v in table.items()})
    link = Link(float("inf"), 1e-9)  # the fitted floor already holds a hop on the measured level
    for s in samples:
        s["predicted_us"] = model.time(s["kind"], n, s["bytes"], link) * 1e6
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        out = {
            "world_size": n,
            "backend": backend,
            "device": name,
            "dtype": str(dtype),
            "fit": table,
            "samples": samples,
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(
            f"wrote {args.out}: "
            + ", ".join(f"{k} {v['floor_us']:.1f} us {v['busbw_GBps']:.1f} GB/s" for k, v in table.items())
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
