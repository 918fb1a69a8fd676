"""Does the GPU wait for data? 20 steps of GPT-2 124M under the CUDA profiler, fed three ways.

    python benchmarks/data_profile.py                 # H200: GPT-2 124M, batch 16 x 1024
    python benchmarks/data_profile.py --device cpu --n-layer 2 --n-embd 64 --seq-len 64   # smoke

One ``fsg.compile_step`` of examples/gpt.py's GPT (bf16 compute, fused AdamW, CUDA-graph
replay; the input/target shift traced into the step from the ``[B, T + 1]`` block), fed by:

  resident    batches already on the device (no data path at all: the reference)
  fsg.data    ``fsg.data.Loader`` over a memory-mapped llm.c token file (1 worker, prefetch 2)
  DataLoader  ``torch.utils.data.DataLoader`` over the same file: 4 worker processes,
              shuffling, ``pin_memory``, ``non_blocking`` copies (what a competent user writes)

For each feed: 5 warm-up steps, then ``--steps`` steps under ``torch.profiler``, with a sync at
the end. From the profile's device events (kernels, copies, memsets) it reports the device's
idle time between the first and last event, the longest idle gap, and the number of gaps over
100 us, beside the wall time per step. A feed that keeps the GPU fed shows the resident feed's
figures.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

import fsg  # noqa: E402
import fsg.data  # noqa: E402
from benchmarks.data import Windows  # noqa: E402


def device_gaps(prof, device: torch.device) -> dict:
    """Idle time between the device's events in ``prof`` (microseconds)."""
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == kind)
    if not spans:
        return {"events": 0, "idle_us": float("nan"), "max_gap_us": float("nan"), "gaps_over_100us": 0}
    idle, longest, over, end = 0.0, 0.0, 0, spans[0][1]
    for start, stop in spans[1:]:
        if start > end:
            gap = start - end
            idle, longest, over = idle + gap, max(longest, gap), over + (gap > 100)
        end = max(end, stop)
    return {"events": len(spans), "window_us": end - spans[0][0], "idle_us": idle, "max_gap_us": longest,
            "gaps_over_100us": over}  # fmt: skip


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50257, block_size=args.seq_len, n_layer=args.n_layer, n_head=max(1, args.n_embd // 64),
                    n_embd=args.n_embd)  # fmt: skip
    model = GPT(cfg).to(device)

    def loss_fn(params, tokens_BT):  # [B, T + 1]: the shift is traced into the step
        return fsg.apply(model, params, tokens_BT[:, :-1], tokens_BT[:, 1:])

    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(3e-4, weight_decay=0.1),
                            precision=fsg.Policy(compute=compute))  # fmt: skip
    holder = [step.init(fsg.params(model))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "tokens.bin")
        fsg.data.write_tokens(path, np.random.default_rng(0).integers(0, 50257, size=args.tokens, dtype=np.int64))
        resident = [torch.randint(0, 50257, (args.batch_size, args.seq_len + 1), device=device) for _ in range(4)]

        def loader_feed():
            return fsg.data.Loader(path, batch_size=args.batch_size, seq_len=args.seq_len, device=device, vocab_size=50257)

        def dataloader_feed():
            dl = torch.utils.data.DataLoader(
                Windows(path, args.seq_len), batch_size=args.batch_size, shuffle=True, num_workers=4,
                pin_memory=device.type == "cuda", prefetch_factor=4, persistent_workers=True, drop_last=True,
            )  # fmt: skip
            return (b.to(device, non_blocking=True) for b in dl)

        feeds = {"resident": lambda: (resident[i % 4] for i in range(10**9)),
                 "fsg.data": loader_feed, "DataLoader": dataloader_feed}  # fmt: skip
        for name, make in feeds.items():
            batches = iter(make())
            for _ in range(5):  # the first call compiles (resident feed)
                holder[0], metrics = step(holder[0], next(batches))
            float(metrics["loss"])
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            with torch.profiler.profile(activities=activities) as prof:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    holder[0], metrics = step(holder[0], next(batches))
                float(metrics["loss"])  # the sync
                ms = (time.perf_counter() - t0) * 1e3 / args.steps
            gaps = device_gaps(prof, device)
            rows.append((name, ms, gaps))
            print(f"{name}: {ms:.2f} ms/step, {gaps}", flush=True)
            if hasattr(batches, "close"):
                batches.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    lines = [
        f"{name}, torch {torch.__version__}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}",
        f"GPT {args.n_layer} layers x {args.n_embd}, batch {args.batch_size} x {args.seq_len}, {args.steps} profiled steps",
        "",
        "| feed | step (ms) | device idle in the window (ms) | longest gap (us) | gaps > 100 us | window (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for feed, ms, g in rows:
        lines.append(f"| {feed} | {ms:.2f} | {g['idle_us'] / 1e3:.2f} | {g['max_gap_us']:.0f} | {g['gaps_over_100us']} | "
                     f"{g.get('window_us', float('nan')) / 1e3:.1f} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
