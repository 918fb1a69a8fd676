"""Per-step time of an fsg step beside an eager PyTorch loop doing the same math, on CPU.

    python benchmarks/step_overhead.py            # prints a markdown table

Two models: a tiny MLP, where per-step overhead dominates, and the example's character GPT.
Each row is the median of ``--iters`` timed steps after ``--warmup`` steps. The eager loop
uses ``torch.optim.AdamW(foreach=True)`` with the same hyperparameters, zero_grad(set_to_none)
and ``loss.backward()``. "fsg wrapper" is the Python work ``Step.__call__`` does besides running
the graph (flattening state and batch, checking the batch signature, reading the recorded
modules' train/eval and ``requires_grad`` flags), timed on its own; "of which flags" the last.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

import fsg  # noqa: E402

LR, WD = 1e-3, 0.1


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def make_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    batch = {"x": torch.randn(32, 64), "y": torch.randint(0, 10, (32,))}
    return model, batch


def make_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    batch = {"x": torch.randint(0, 96, (32, 64)), "y": torch.randint(0, 96, (32, 64))}
    return model, batch


def bench(name, make, warmup, iters):
    rows = []
    model, batch = make()

    def loss_fn(params, batch):
        return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])

    # Eager PyTorch: the same loss, backward, and torch.optim.AdamW (foreach).
    eager_model, _ = make()
    opt = torch.optim.AdamW(eager_model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        fsg.nn.cross_entropy(eager_model(batch["x"]), batch["y"]).backward()
        opt.step()

    eager = median_ms(eager_step, warmup, iters)
    rows.append((name, "eager PyTorch + AdamW(foreach)", eager, None))

    for backend in ("aot_eager", "inductor"):
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(LR, weight_decay=WD), backend=backend)
        state = step.init(fsg.params(model))
        t0 = time.perf_counter()
        state, _ = step(state, batch)
        compile_s = time.perf_counter() - t0
        holder = [state]

        def fsg_step():
            holder[0], _ = step(holder[0], batch)

        ms = median_ms(fsg_step, warmup, iters)
        # The Python work of Step.__call__ besides the graph: flatten + signature check + module flags.
        wrapper = median_ms(lambda: (step._signature(holder[0], batch), step._flags.now()), warmup, iters)
        flags = median_ms(step._flags.now, warmup, iters)
        rows.append((name, f"fsg ({backend})", ms, (compile_s, wrapper, flags)))
    return rows, eager


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, fsg {fsg.__version__}, Python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")  # fmt: skip
    print()
    print(
        "| model | implementation | step (ms, median) | eager / this | first call incl. compile (s) | fsg wrapper (ms) "
        "| of which flags (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, make in (("MLP 64x3, batch 32", make_mlp), ("char GPT 0.6M, 32x64 tokens", make_gpt)):
        rows, eager = bench(name, make, args.warmup, args.iters)
        for model, impl, ms, extra in rows:
            compile_s, wrapper, flags = extra if extra else (None, None, None)
            print(
                f"| {model} | {impl} | {ms:.3f} | {eager / ms:.2f}x | "
                f"{'' if compile_s is None else f'{compile_s:.1f}'} | {'' if wrapper is None else f'{wrapper:.3f}'} | "
                f"{'' if flags is None else f'{flags:.4f}'} |"
            )


if __name__ == "__main__":
    main()
