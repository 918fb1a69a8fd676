"""Convergence: fsg's loss curve beside the strongest torch.compile baseline, same init and batches.

    python benchmarks/convergence.py                         # GPT-2 124M, 300 steps, 2 runs each
    python benchmarks/convergence.py --impl compile,fsg-autocast --steps 300 --runs 2
    python benchmarks/convergence.py --model tiny --device cpu --steps 20 --batch 2 --seq 128   # CPU smoke run

GPT-2 124M (examples/gpt.py: vocab 50304, 1024 positions, tied head) trained on real text: the
bytes of Python's standard library sources (every machine has them), batch 16 x 1024 tokens
drawn at fixed random offsets (the same batches for every run), float32 params and AdamW state
(betas 0.9/0.95, weight decay 0.1, eps 1e-8), learning rate ``fsg.optim.warmup_cosine(6e-4,
warmup=30, total=steps, end_value=6e-5)`` on both sides (the baseline calls the same schedule; runs
shorter than 300 steps warm up for a tenth of them).

Implementations (--impl), each in its own process; within it, --runs runs from the same
initial weights (the compiled step is reused, so the runs differ only by the kernels' own
non-determinism, e.g. atomic adds in reductions):
  compile        torch.compile of (ids, targets) -> loss: model and loss in one compiled
                 region, autocast bf16, the loss on float32 logits, torch.optim.AdamW(fused=True)
  fsg-autocast   fsg.compile_step, Policy(compute=bf16, autocast=True): the loss traced under
                 autocast (what the baseline computes, op for op), fused head + loss
  fsg            fsg.compile_step, Policy(compute=bf16): every parameter cast to bf16 where read
  fsg-fp8        fsg with Policy(compute=bf16, matmul=fsg.Float8()): tensorwise FP8 linear layers
  fsg-fp8-row    fsg with Float8(recipe="rowwise"): rowwise FP8, the grad-weights in bf16
  fsg-fp8-row-gw fsg with Float8(recipe="rowwise", grad_weight="fp8"): the grad-weights in FP8 too
  fsg-fp8*-fastgi, fsg-fp8*-fastall
                 the same with Float8(fast_accum=("forward", "grad_input")): the grad-inputs
                 accumulate fast too; -fastall: the grad-weights too
  fsg-fp8-row*-noln
                 the same with the layer norms (and their residual adds) left to Inductor, not in
                 fsg's FP8 cast kernels (Fusions(fp8_layer_norms=False); -ln, the default)
  compile-fp8, compile-fp8-row, compile-fp8-row-gwhp
                 compile after torchao's convert_to_float8_training (needs torchao), recipe
                 "tensorwise", "rowwise" (every matmul FP8, as fsg-fp8-row-gw) or
                 "rowwise_with_gw_hp" (grad-weights in bf16, as fsg-fp8-row); the head in bf16

Reported: the mean loss of the last 25 steps of each run; the mean absolute difference between
two curves' 25-step moving averages (steps 25 to the end) for each pair of runs: a baseline
pair gives the baseline's own run-to-run spread, and fsg counts as converging alike when its
distance to the baseline is within that spread; the median step time over the steps after the
10th (each step's loss is kept on the device and read at the end), and the peak memory.
Held-out: each run's final weights loaded into a fresh float32 model and evaluated under
autocast bf16 (no FP8 anywhere) on --eval-batches batches of text no run trains on (the
installed torch package's .py sources): it tells a model that learned better from a loss that
only its own training forward reports (a forward that sees what it should not would lose its
advantage here).
With --parallel the implementations' processes run side by side (their step times are then
not comparable; the losses are).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from subprocess import PIPE

from _common import byte_windows, float8_config, torchao_float8

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"124m": (12, 12, 768), "tiny": (2, 4, 64)}
B1, B2, WD, EPS = 0.9, 0.95, 0.1, 1e-8
WINDOW = 25


def stdlib_bytes(limit: int) -> bytes:
    """Up to ``limit`` bytes of the standard library's .py sources, in a fixed order."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(out)[:limit]


def batches(steps: int, batch: int, seq: int, device: str):
    """The training batches: windows of Python's standard library sources."""
    return byte_windows(stdlib_bytes(64 << 20), steps, batch, seq, seed=0, device=device)


def heldout_batches(n: int, batch: int, seq: int, device: str):
    """``n`` batches of the installed torch package's .py sources: text no run trains on."""
    import torch

    out, size = [], 0
    for path in sorted(Path(torch.__file__).parent.rglob("*.py")):
        out.append(path.read_bytes())
        size += len(out[-1])
        if size >= 16 << 20:
            break
    return byte_windows(b"".join(out), n, batch, seq, seed=1, device=device)


def evaluate(weights: dict, cfg, data, device: str) -> float:
    """The mean loss of ``weights`` (a state dict; tied names may be absent) over ``data``, in
    a fresh float32 model under autocast bf16."""
    import torch
    import torch.nn.functional as F

    from examples.gpt import GPT

    model = GPT(cfg).to(device)
    tied = set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        losses = [F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) for x, y in data]
    return float(torch.stack(losses).mean())


def run(impl: str, args) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    import fsg
    from examples.gpt import GPT, GPTConfig

    layers, heads, dim = MODELS[args.model]
    dev = args.device
    cfg = GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=layers, n_head=heads, n_embd=dim)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = batches(args.steps, args.batch, args.seq, dev)
    schedule = fsg.optim.warmup_cosine(args.lr, warmup=min(30, args.steps // 10), total=args.steps, end_value=args.lr / 10)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    if impl.startswith("compile"):
        if impl != "compile":
            torchao_float8(model, impl)

        def loss_of(x, y):
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = model(x)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

        compiled = torch.compile(loss_of)

        def start():
            model.load_state_dict(init)  # in place: the compiled graph is kept
            opt = torch.optim.AdamW(
                model.parameters(), lr=args.lr, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=dev == "cuda"
            )

            def step(i, x, y):
                for group in opt.param_groups:
                    group["lr"] = float(schedule(torch.tensor(i)))
                loss = compiled(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach().clone()

            return step, model.state_dict

    else:
        from fsg._src.passes.options import Fusions

        fusions = Fusions(fp8_layer_norms=not impl.endswith("-noln"))  # as benchmarks/gpt.py's -noln rows
        impl = impl.removesuffix("-noln").removesuffix("-ln")  # -ln: the default
        matmul = float8_config(impl, {
            "fsg-fp8": fsg.Float8(),
            "fsg-fp8-row": fsg.Float8(recipe="rowwise"),
            "fsg-fp8-row-gw": fsg.Float8(recipe="rowwise", grad_weight="fp8"),
        })
        policy = fsg.Policy(compute=torch.bfloat16, autocast=impl == "fsg-autocast", matmul=matmul)
        train = fsg.compile_step(
            lambda params, b: fsg.apply(model, params, b["x"], b["y"]),
            optimizer=fsg.optim.adamw(schedule, b1=B1, b2=B2, eps=EPS, weight_decay=WD),
            precision=policy,
            fusions=fusions,
        )

        def start():
            model.load_state_dict(init)
            holder = [train.init(fsg.params(model))]

            def step(i, x, y):
                holder[0], metrics = train(holder[0], {"x": x, "y": y})
                return metrics["loss"].clone()  # replay reuses the graph's output buffers

            return step, lambda: holder[0].params

    runs, times, heldout = [], [], []
    held = heldout_batches(args.eval_batches, args.batch, args.seq, dev)
    for _ in range(args.runs):
        step, weights = start()
        losses, stamps = [], []
        for i, (x, y) in enumerate(data):
            losses.append(step(i, x, y))
            if i >= 10:
                sync()
                stamps.append(time.perf_counter())
        runs.append([float(v) for v in torch.stack(losses).cpu()])
        heldout.append(evaluate(weights(), cfg, held, dev))
        times.extend(b - a for a, b in zip(stamps, stamps[1:]))
    times.sort()
    return {
        "losses": runs,
        "heldout": heldout,
        "ms": times[len(times) // 2] * 1e3 if times else float("nan"),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan"),
    }


def _tail(curve: list[float]) -> float:
    """The mean of the last ``WINDOW`` losses (the "final loss" compared across implementations)."""
    return sum(curve[-WINDOW:]) / min(WINDOW, len(curve))


def moving(curve: list[float]) -> list[float]:
    return [sum(curve[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(curve) + 1)]


def distance(a: list[float], b: list[float]) -> float:
    ma, mb = moving(a), moving(b)
    return sum(abs(x - y) for x, y in zip(ma, mb)) / max(len(ma), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="124m", choices=sorted(MODELS))
    parser.add_argument("--impl", default="compile,fsg-autocast,fsg")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches each run is evaluated on")
    parser.add_argument("--parallel", action="store_true", help="run the implementations side by side")
    parser.add_argument("--json", help="write every run's losses here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run(args.child, args)), flush=True)
        return
    import torch

    results, impls = {}, args.impl.split(",")

    def launch(impl):
        print(f"[convergence] {impl}: {args.runs} runs of {args.steps} steps ...", flush=True)
        argv = [sys.executable, __file__, "--child", impl, *sys.argv[1:]]
        return impl, time.perf_counter(), subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, text=True, cwd=ROOT)

    def collect(impl, t0, proc):
        out, err = proc.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"[convergence] {impl} failed:", out[-3000:], err[-6000:], sep="\n", flush=True)
            return
        results[impl] = json.loads(lines[-1][len("RESULT ") :])
        print(f"  {impl} done in {time.perf_counter() - t0:.0f} s", flush=True)

    if args.parallel:
        for job in [launch(impl) for impl in impls]:
            collect(*job)
    else:
        for impl in impls:
            collect(*launch(impl))
    results = {impl: results[impl] for impl in impls if impl in results}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}))

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"\n{args.model}, {args.steps} steps, batch {args.batch} x {args.seq}, {gpu}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    first = next(iter(results.values()), None)
    base = (_tail(first["losses"][0]), first["heldout"][0]) if first else (math.nan, math.nan)
    print(f"| implementation | run | mean loss, last 25 steps | held-out loss (bf16 eval) | vs {impls[0]} #1 (last 25 / "
          "held-out) | non-finite losses | step (ms, median) | peak (GiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for impl, r in results.items():
        for k, curve in enumerate(r["losses"]):
            tail, held = _tail(curve), r["heldout"][k]
            bad = sum(not math.isfinite(v) for v in curve)
            vs = f"{tail / base[0] - 1:+.2%} / {held / base[1] - 1:+.2%}"
            print(f"| {impl} | {k + 1} | {tail:.4f} | {held:.4f} | {vs} | {bad} | {r['ms']:.2f} | {r['peak_gib']:.2f} |")
    print("\nMean |difference| of 25-step moving averages (steps 25..end):\n")
    print("| curve A | curve B | distance |")
    print("|---|---|---|")
    named = [(f"{impl} #{k + 1}", c) for impl, r in results.items() for k, c in enumerate(r["losses"])]
    for i, (na, a) in enumerate(named):
        for nb, b in named[i + 1 :]:
            print(f"| {na} | {nb} | {distance(a, b):.4f} |")


if __name__ == "__main__":
    main()
