"""fsg.data.Loader against torch.utils.data.DataLoader doing the same work: batches per second.

    python benchmarks/data.py                       # CPU
    python benchmarks/data.py --device cuda         # H200: GPT-2 124M shapes (16 x 1024)

Both read the same memory-mapped llm.c token file (GPT-2 sized ids, generated), deliver
``[B, T + 1]`` int64 blocks of random windows on ``--device``, and are timed over ``--batches``
batches after a warm-up, with a device sync at the end. The DataLoader baseline is the setup a
competent user writes: a map-style dataset of windows, a shuffling sampler, ``batch_size=B``,
``--workers`` worker processes, ``pin_memory`` on CUDA and ``non_blocking`` copies. The loader
is timed with each of ``--loader-workers`` background threads (0: built in the caller's thread;
``prefetch`` is raised to the worker count where it is lower). The last rows time the loader
while the "step" is busy (a matmul loop on the device), to show the batch is ready when asked.
Writes a markdown table to stdout (and to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsg.data  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """The baseline's dataset: window ``i`` of ``T + 1`` tokens of a memory-mapped token file."""

    def __init__(self, path: str, seq_len: int):
        self.path, self.seq_len = path, seq_len
        layout = fsg.data.read_layout(path)
        self.layout, self.map = layout, None
        self.num = (layout.count - 1) // seq_len

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.map is None:  # opened in each worker
            lay = self.layout
            self.map = np.memmap(self.path, dtype=lay.dtype, mode="r", offset=lay.offset, shape=(lay.count,))
        s = i * self.seq_len
        return torch.from_numpy(self.map[s : s + self.seq_len + 1].astype(np.int64))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_batches(batches, n: int, device: torch.device, work=None) -> float:
    """Batches per second over ``n`` batches of the iterator (after 5 warm-up batches)."""
    for _ in range(5):
        next(batches)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        batch = next(batches)
        if work is not None:
            work(batch)
    sync(device)
    return n / (time.perf_counter() - t0)


def dataloader_batches(path: str, args, device: torch.device):
    loader = torch.utils.data.DataLoader(
        Windows(path, args.seq_len), batch_size=args.batch_size, shuffle=True, drop_last=True,
        num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0,
        prefetch_factor=args.prefetch if args.workers else None, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    while True:
        for batch in loader:
            yield batch.to(device, non_blocking=True)


def busy_step(device: torch.device, ms: float):
    """A stand-in train step: device work of about ``ms`` milliseconds that reads the batch."""
    x = torch.randn(1024, 1024, device=device)
    for _ in range(50):  # warm-up (library start-up, clocks), not timed: timing it made the step ~50x too short
        x @ x
    sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        x @ x
    sync(device)
    reps = max(1, int(ms / 1e3 / ((time.perf_counter() - t0) / 20)))

    def work(batch):
        y = x
        for _ in range(reps):
            y = y @ x
        return y.sum() + batch[0, 0]

    return work


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=50_000_000, help="size of the generated token file")
    p.add_argument("--batches", type=int, default=500)
    p.add_argument("--workers", type=int, default=4, help="DataLoader worker processes")
    p.add_argument("--prefetch", type=int, default=4, help="batches ahead (both loaders)")
    p.add_argument("--loader-workers", default="0,1,2,4", help="fsg.data.Loader(workers=...) counts to time")
    p.add_argument("--repeats", type=int, default=3, help="timings of each loader setup (the median is shown)")
    p.add_argument("--step-ms", type=float, default=30.0, help="device work per batch in the busy row (124M: ~31 ms)")
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    device = torch.device(args.device)

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "tokens.bin")
        ids = np.random.default_rng(0).integers(0, 50257, size=args.tokens, dtype=np.int64)
        fsg.data.write_tokens(path, ids)
        del ids

        def fsg_batches(workers: int):
            return fsg.data.Loader(path, batch_size=args.batch_size, seq_len=args.seq_len, device=device,
                                   prefetch=max(args.prefetch, workers), workers=workers, vocab_size=50257)  # fmt: skip

        def setup(workers: int) -> str:
            ahead = max(args.prefetch, workers)
            return (
                "in the caller's thread"
                if workers == 0
                else f"{workers} worker thread{'s' * (workers > 1)}, prefetch {ahead}"
            )

        counts = [int(w) for w in args.loader_workers.split(",")]
        rates = {w: [] for w in counts}
        for _ in range(args.repeats):  # interleaved, so that a noisy neighbour hits every count alike
            for workers in counts:
                with fsg_batches(workers) as loader:
                    rates[workers].append(time_batches(loader, args.batches, device))
        rows = [("fsg.data.Loader", setup(w), rates[w]) for w in counts]
        rows.append((
            "torch DataLoader", f"{args.workers} workers, prefetch_factor {args.prefetch}",
            [time_batches(dataloader_batches(path, args, device), args.batches, device)],
        ))  # fmt: skip
        work = busy_step(device, args.step_ms)
        n_busy = max(20, args.batches // 10)
        step_alone = time_batches(iter(lambda: torch.zeros(1, 1, device=device), None), n_busy, device, work)
        fed = []
        for workers in counts:
            with fsg_batches(workers) as loader:
                fed.append((setup(workers), time_batches(loader, n_busy, device, work)))

    tokens = args.batch_size * args.seq_len
    lines = [
        f"fsg.data benchmark: {args.batch_size} x {args.seq_len + 1} int64 blocks on {device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}), "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
        "",
        f"| loader | setup | batches/s (median of {args.repeats}) | min-max | tokens/s |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {setup} | {statistics.median(r):,.0f} | {min(r):,.0f}-{max(r):,.0f} | "
            f"{statistics.median(r) * tokens:,.0f} |"
            for name, setup, r in rows
        ),
        "",
        f"| stand-in step (~{args.step_ms:.0f} ms of device work) | steps/s |",
        "|---|---|",
        f"| without data | {step_alone:,.1f} |",
        *(
            f"| fed by fsg.data.Loader, {name} | {rate:,.1f} ({100 * rate / step_alone:.0f}% of the step alone) |"
            for name, rate in fed
        ),
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
