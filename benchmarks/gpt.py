"""GPT-2 train step on one GPU: fsg beside eager PyTorch, torch.compile and JAX, one run.

    python benchmarks/gpt.py --model 124m                     # all implementations
    python benchmarks/gpt.py --model 355m --impl fsg,compile,jax
    python benchmarks/gpt.py --model 124m --impl fsg,fsg --name warm-cache   # 2nd start: cache

Same step everywhere: GPT-2 shapes (vocab 50304, 1024 positions, tied head), batch 16 x 1024
tokens, float32 params and AdamW state (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on all
params, eps 1e-8), bfloat16 compute (torch: autocast; fsg: ``fsg.Policy``; JAX: params cast
to bf16 in the loss), the loss in float32. Each implementation runs in its own process (clean
memory statistics, no allocator sharing, JAX not preallocating), one after the other on the
same GPU. Step time is the mean over --steps timed steps after --warmup untimed ones (the
first of which compiles: "compile" is its wall time); "median step" is the median of the
steps' device times (a CUDA event after each; torch rows only): the timed steps run at the
H200's power cap, where a clock dip makes one or two steps slow. Peak memory is the process's peak over
the whole run, compile and CUDA-graph capture included (torch: max_memory_allocated; JAX:
peak_bytes_in_use); "reserved" is what the allocator held at most (torch:
max_memory_reserved; JAX: peak_bytes_reserved where reported). MFU counts
6 N + 12 L T D FLOPs per token (N: params without the position embedding) against 989 TFLOP/s.
An fsg row whose versions column names cudnn-frontend ran with NVIDIA's cuDNN frontend
installed (`pip install -e ".[cudnn]"`): without it the attention backward's qkv gradient is
concatenated (the `-catgrads` rows).

Implementations (--impl, comma-separated): a base name and suffixes, the registry of
benchmarks/gpt_impls.py (`python benchmarks/gpt.py --help` lists them); a name it does not
know is an error. Each fsg variant that turns a fusion off does so through
`compile_step(fusions=Fusions(...))`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import gpt_impls
from _common import profile_table, torchao_float8

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"124m": (12, 12, 768), "355m": (24, 16, 1024), "1.3b": (24, 16, 2048), "tiny": (2, 4, 128)}
LR, B1, B2, WD, EPS = 6e-4, 0.9, 0.95, 0.1, 1e-8
MUON_LR = 0.02  # torch.optim.Muon for the hidden matrices (Keller Jordan's; its default 1e-3 is AdamW-like)
PEAK_TFLOPS = 989.0


def flops_per_step(layers: int, dim: int, n_params: int, batch: int, seq: int) -> float:
    return (6 * n_params + 12 * layers * seq * dim) * batch * seq


# --- one implementation per process -----------------------------------------------------------


def _batches(n, vocab, batch, seq, device, lib="torch"):
    import torch

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]
    if lib == "jax":
        return [(d[:, :-1].numpy(), d[:, 1:].numpy()) for d in data]
    return [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]


def run_torch(impl: str, args) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    import fsg
    from examples.gpt import GPT, GPTConfig

    spec = gpt_impls.resolve(impl)
    auto_figures = spec.has("-auto")
    row, impl = impl, spec.base  # the row's full name (its profile's file), and what it varies
    layers, heads, dim = MODELS[args.model]
    cfg = GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=layers, n_head=heads, n_embd=dim)
    torch.manual_seed(0)
    dev = args.device
    cuda = dev == "cuda"
    model = GPT(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    batches = _batches(4, cfg.vocab_size, args.batch, args.seq, dev)

    if impl in ("eager", "compile-model"):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=cuda)
        fwd = torch.compile(model) if impl == "compile-model" else model

        def step(i):
            x, y = batches[i % len(batches)]
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = fwd(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    elif impl.startswith("compile"):
        if impl in ("compile-fp8", "compile-fp8-row"):
            torchao_float8(model, impl)

        def loss_of(x, y):
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = model(x)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

        compiled = torch.compile(loss_of, mode="max-autotune-no-cudagraphs" if impl == "compile-max" else None)
        if impl.endswith("-muon"):
            hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
            rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
            muon = torch.optim.Muon(hidden, lr=MUON_LR, weight_decay=WD)
            adamw = torch.optim.AdamW(rest, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=cuda)

            def both_steps():
                muon.step()
                adamw.step()

            opt = muon  # zero_grad below; AdamW's grads are cleared with the model's
            opt_step = torch.compile(both_steps) if impl == "compile-opt-muon" else both_steps
        elif impl in ("compile-opt", "compile-opt-nomix"):  # torch's recipe for a compiled optimizer: a tensor lr, foreach
            opt = torch.optim.AdamW(
                model.parameters(), lr=torch.tensor(LR) if cuda else LR, betas=(B1, B2), eps=EPS, weight_decay=WD,
                foreach=True, capturable=cuda,
            )  # fmt: skip
            opt_step = torch.compile(opt.step)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=cuda)
            opt_step = opt.step

        def step(i):
            x, y = batches[i % len(batches)]
            loss = compiled(x, y)
            loss.backward()
            opt_step()
            (model.zero_grad if impl.endswith("-muon") else opt.zero_grad)(set_to_none=True)
            return loss

    else:
        from fsg._src.passes.options import Fusions

        logits_loss = impl == "fsg-logits"

        def loss_fn(params, batch):
            if logits_loss:
                return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])
            return fsg.apply(model, params, batch["x"], batch["y"])

        adamw = fsg.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
        if impl == "fsg-muon":
            hidden = lambda p: {k: "muon" if v.ndim == 2 and k.startswith("blocks.") else "adamw" for k, v in p.items()}  # noqa: E731
            adamw = fsg.optim.multi_transform({"muon": fsg.optim.muon(MUON_LR, weight_decay=WD), "adamw": adamw}, hidden)
        matmul = None if spec.float8 is None else fsg.Float8(**spec.float8)
        if spec.has("-bf16proj") and matmul is not None:  # the attention's output projection in bf16
            matmul = fsg.Float8(**{**matmul._asdict(), "filter": lambda name: ".attn.proj." not in name})
        if spec.has("-auto") and matmul is not None:  # the layers chosen by the cost model, measured on this GPU
            matmul = fsg.Float8(**{**matmul._asdict(), "filter": "auto"})
        fstep = fsg.compile_step(
            loss_fn,
            optimizer=adamw,
            precision=fsg.Policy(compute=torch.bfloat16, autocast=impl == "fsg-autocast", matmul=matmul),
            cuda_graph=False if impl == "fsg-nograph" else None,
            fused_optimizer=False if impl == "fsg-nofuse" else None,
            skip_nonfinite=impl == "fsg-skip",
            fusions=Fusions(**spec.fusions),
            backend=args.backend,
        )
        state = fstep.init(fsg.params(model))
        for p in model.parameters():  # the module is only a template now: drop its own copy
            p.data = torch.empty(0, device=dev)
        holder = [state]

        def step(i):
            x, y = batches[i % len(batches)]
            holder[0], metrics = fstep(holder[0], {"x": x, "y": y})
            return metrics["loss"]

    import logging

    stages: list[str] = []  # fsg's per-stage timings (INFO records of the "fsg" logger)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: stages.append(record.getMessage())
    logging.getLogger("fsg").addHandler(handler)
    logging.getLogger("fsg").setLevel(logging.INFO)
    if auto_figures:  # Float8(filter="auto"): each kept layer's figures (DEBUG) in the result too
        figures = logging.Handler(logging.DEBUG)
        figures.addFilter(lambda r: r.levelno < logging.INFO and "its FP8 GEMMs save" in r.getMessage())
        figures.emit = lambda record: stages.append(record.getMessage())
        logging.getLogger("fsg").addHandler(figures)
        logging.getLogger("fsg").setLevel(logging.DEBUG)
    profile_to = os.environ.get("FSG_PROFILE_FIRST_CALL")  # a path: cProfile of the first call
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    peak_to = os.environ.get("FSG_MEMORY_PEAK") if cuda else None  # a path prefix: memory_peak's census
    if peak_to:
        import memory_peak

        memory_peak.record()
    t0 = time.perf_counter()
    first = float(step(0))
    compile_s = time.perf_counter() - t0
    if profile_to:
        import pstats

        profiler.disable()
        with open(profile_to, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(80)
    t0 = time.perf_counter()
    step(1)
    float(step(2))
    second_s = time.perf_counter() - t0  # calls 2-3: fsg captures its CUDA graph in call 2
    for i in range(3, args.warmup):
        step(i)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if peak_to:
        print(memory_peak.census(f"{peak_to}.{args.model}.{row}.txt"), flush=True)
    # an event after each step: the per-step device times show a trend (clocks settling under
    # sustained load) that the mean alone hides
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)] if cuda else []
    t0 = time.perf_counter()
    for i in range(args.steps):
        if events:
            events[i].record()
        loss = step(i)
    if events:
        events[-1].record()
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    step_ms = [round(a.elapsed_time(b), 3) for a, b in zip(events, events[1:])]
    if args.profile:
        profile_table(step, sync, Path(f"{args.profile}.{args.model}.{row}.txt"))
    return {
        "ms": ms,
        "step_ms": step_ms,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan"),
        "compile_s": compile_s,
        "calls_2_3_s": second_s,
        "stages": stages,
        "first_loss": first,
        "last_loss": float(loss),
        "n_params": n_params,
        "versions": f"torch {torch.__version__}" + _cudnn_frontend(impl),
    }


def _cudnn_frontend(impl: str) -> str:
    """``", cudnn-frontend X"`` for an fsg row run with NVIDIA's cuDNN frontend installed (with
    it attention's backward writes the qkv gradient in place: docs/kernels.md), else ``""``."""
    if not impl.startswith("fsg"):
        return ""
    try:
        from importlib.metadata import version

        return f", cudnn-frontend {version('nvidia-cudnn-frontend')}"
    except Exception:  # noqa: BLE001 - not installed
        return ""


def run_jax(args) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import optax

    layers, heads, dim = MODELS[args.model]
    V, T, K = 50304, args.seq, dim // heads
    key = jax.random.PRNGKey(0)
    ks = iter(jax.random.split(key, 16))
    std, proj_std = 0.02, 0.02 / (2 * layers) ** 0.5

    def normal(shape, s=std):
        return s * jax.random.normal(next(ks), shape, jnp.float32)

    params = {
        "wte": normal((V, dim)),
        "wpe": normal((T, dim)),
        "lnf_g": jnp.ones(dim),
        "lnf_b": jnp.zeros(dim),
        "blocks": {  # stacked over layers: the step scans them
            "ln1_g": jnp.ones((layers, dim)),
            "ln1_b": jnp.zeros((layers, dim)),
            "w_qkv": normal((layers, dim, 3 * dim)),
            "b_qkv": jnp.zeros((layers, 3 * dim)),
            "w_proj": normal((layers, dim, dim), proj_std),
            "b_proj": jnp.zeros((layers, dim)),
            "ln2_g": jnp.ones((layers, dim)),
            "ln2_b": jnp.zeros((layers, dim)),
            "w_fc": normal((layers, dim, 4 * dim)),
            "b_fc": jnp.zeros((layers, 4 * dim)),
            "w_fcp": normal((layers, 4 * dim, dim), proj_std),
            "b_fcp": jnp.zeros((layers, dim)),
        },
    }
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params)) - params["wpe"].size

    def layer_norm(x, g, b):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(x.dtype)

    def attention(q, k, v):
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        except Exception:  # noqa: BLE001 - no cuDNN flash attention: let XLA choose
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def loss_fn(params, x, y):
        p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
        B = x.shape[0]
        h = p["wte"][x] + p["wpe"][:T]

        def block(h, w):
            a = layer_norm(h, w["ln1_g"], w["ln1_b"]) @ w["w_qkv"] + w["b_qkv"]
            q, k, v = (t.reshape(B, T, heads, K) for t in jnp.split(a, 3, axis=-1))
            h = h + attention(q, k, v).reshape(B, T, dim) @ w["w_proj"] + w["b_proj"]
            f = jax.nn.gelu(layer_norm(h, w["ln2_g"], w["ln2_b"]) @ w["w_fc"] + w["b_fc"], approximate=True)
            return h + f @ w["w_fcp"] + w["b_fcp"], None

        h, _ = jax.lax.scan(block, h, p["blocks"])
        logits = layer_norm(h, p["lnf_g"], p["lnf_b"]) @ p["wte"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    opt = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    opt_state = opt.init(params)

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))
    batches = [tuple(jax.device_put(a) for a in b) for b in _batches(4, V, args.batch, T, None, lib="jax")]
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, *batches[0])
    first = float(loss)
    compile_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        params, opt_state, loss = step(params, opt_state, *batches[i % 4])
    loss.block_until_ready()
    t0 = time.perf_counter()
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, *batches[i % 4])
    loss.block_until_ready()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "ms": ms,
        "peak_gib": stats.get("peak_bytes_in_use", float("nan")) / 2**30,
        # XLA reports no reserved peak on this stack (bytes_reserved reads 0): leave it empty
        "reserved_gib": stats["peak_bytes_reserved"] / 2**30 if stats.get("peak_bytes_reserved") else float("nan"),
        "compile_s": compile_s,
        "first_loss": first,
        "last_loss": float(loss),
        "n_params": n_params,
        "versions": f"jax {jax.__version__}, optax {optax.__version__}",
    }


# --- driver -------------------------------------------------------------------------------------


def child(args) -> None:
    out = run_jax(args) if args.child == "jax" else run_torch(args.child, args)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="implementations:\n" + gpt_impls.describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="124m")
    parser.add_argument(
        "--impl", type=gpt_impls.impl_list, default="compile,compile-opt,fsg,fsg-autocast", help="comma-separated"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--name", default="", help="a label for the table rows")
    parser.add_argument("--profile", default="", help="a path prefix: a CUDA-time table of 3 more steps per row")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script (torch rows)")
    parser.add_argument("--backend", default="inductor", help="fsg's backend; aot_eager only to smoke-test the script")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    layers, _, dim = MODELS[args.model]
    rows = []
    for impl in (spec.name for spec in args.impl):
        print(f"[gpt {args.model}] {impl} ...", flush=True)
        cmd = [sys.executable, __file__, "--child", impl, *sys.argv[1:]]
        env = {**os.environ, "TORCHINDUCTOR_MIX_ORDER_REDUCTION": "0"} if impl.endswith("-nomix") else None
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", flush=True)
            rows.append((impl, None))
            continue
        rows.append((impl, json.loads(lines[-1][7:])))
        print(f"  {rows[-1][1]}", flush=True)
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU"
    print(f"\n{device}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(f"GPT-2 {args.model}, batch {args.batch} x {args.seq}, {args.name}\n")
    print("| implementation | step (ms) | median step (ms) | tokens/s | MFU | peak mem (GiB) | reserved (GiB) | "
          "compile (s) | loss first -> last | versions |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for impl, r in rows:
        if r is None:
            print(f"| {impl} | failed |  |  |  |  |  |  |  |  |")
            continue
        tokens = args.batch * args.seq
        mfu = flops_per_step(layers, dim, r["n_params"], args.batch, args.seq) / (r["ms"] / 1e3) / 1e12 / PEAK_TFLOPS
        steps = sorted(r.get("step_ms") or [float("nan")])  # device time per step (CUDA events)
        print(
            f"| {impl} | {r['ms']:.2f} | {steps[len(steps) // 2]:.2f} | {tokens / r['ms'] * 1e3:,.0f} | {mfu:.1%} | "
            f"{r['peak_gib']:.2f} | {r['reserved_gib']:.2f} | "
            f"{r['compile_s']:.1f} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | {r['versions']} |"
        )


if __name__ == "__main__":
    main()
