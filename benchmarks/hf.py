"""Hugging Face models on one GPU: fsg.compile_step beside torch.compile(model + loss), one run.

    python benchmarks/hf.py                       # GPT-2 124M and the Llama-style 150M
    python benchmarks/hf.py --model llama --impl compile,fsg --steps 30
    python benchmarks/hf.py --model llama1b --batch 4 --impl fsg,fsg-fp8,fsg-fp8-nogated,compile-fp8-row

The models are `transformers` classes built from configs (no download): GPT-2 124M (12 layers,
768 wide, tied head) and a Llama-style 150M (12 layers, 768 wide, 12 query / 4 key-value heads,
MLP 2048, vocabulary 32000); and `llama1b`, a Llama 3.2 1B shape (16 layers, 2048 wide, 32
query / 8 key-value heads, SwiGLU MLP 8192; vocabulary 32000), where FP8 matmuls pay. Same step
for every implementation: the model's own causal-LM
loss (`model(input_ids, labels=...).loss`), batch 8 x 1024 tokens, float32 params and AdamW
state (lr 3e-4, betas 0.9/0.95, weight decay 0.1, eps 1e-8), bfloat16 compute, same initial
weights and batches.

Implementations (--impl), each in its own process:
  compile   torch.compile of the function (ids -> loss): model and loss in one compiled region,
            autocast bf16, torch.optim.AdamW(fused=True); --compile-mode picks the mode
  compile-ro  the same in mode="reduce-overhead" (torch.compile's own CUDA graphs of the
            forward and backward), the strongest setup a user could pick
  fsg       fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(...), precision=bf16 compute),
            every default on (fused AdamW, CUDA-graph replay, the model's cross-entropy traced
            fused with its output projection)
  fsg-unfused  the same with fused_loss=False: the loss traced as the model writes it
  fsg-fp8   fsg with Float8(recipe="rowwise", fast_accum=("forward", "grad_input")): the
            linear layers' forward and grad-input matmuls in FP8, the casts fused into their
            producers (the gated MLP's: kernels/fp8/gated.py)
  fsg-fp8-nogated  the same without the gated MLP's fused casts (Inductor computes them):
            what kernels/fp8/gated.py is measured against
  compile-fp8-row  compile after torchao's convert_to_float8_training (rowwise), the head in
            bf16: the layer-by-layer FP8 baseline (torchao carried to the GPU machine)
Step time: mean over --steps timed steps after --warmup (the first compiles). Peak memory:
torch.cuda.max_memory_allocated over the whole process.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from _common import profile_table, torchao_float8

ROOT = Path(__file__).resolve().parents[1]
LR, B1, B2, WD, EPS = 3e-4, 0.9, 0.95, 0.1, 1e-8


def make_model(kind: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=50304, n_positions=1024, n_layer=12, n_head=12, n_embd=768,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return GPT2LMHeadModel(config)
    if kind == "llama1b":
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1024)  # fmt: skip
        return LlamaForCausalLM(config)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024)  # fmt: skip
    return LlamaForCausalLM(config)


def run(kind: str, impl: str, args) -> dict:
    import torch

    import fsg

    model = make_model(kind).cuda()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=g).cuda() for _ in range(4)]
    if impl in ("compile", "compile-ro", "compile-fp8-row"):
        if impl == "compile-fp8-row":
            torchao_float8(model, impl)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)

        def loss_of(ids):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(input_ids=ids, labels=ids).loss

        compiled = torch.compile(loss_of, mode="reduce-overhead" if impl == "compile-ro" else args.compile_mode)

        def step(i):
            if impl == "compile-ro":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten
            loss = compiled(batches[i % 4])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach().clone() if impl == "compile-ro" else loss

    else:

        def loss_fn(params, batch):
            return fsg.apply(model, params, input_ids=batch["ids"], labels=batch["ids"]).loss

        matmul = None
        if impl.startswith("fsg-fp8"):
            matmul = fsg.Float8(recipe="rowwise", fast_accum=("forward", "grad_input"))
        from fsg._src.passes.options import FP8_PRODUCERS, Fusions

        gated = {"mul", "silu_backward"}  # the gated MLP's product and SiLU gradient
        producers = FP8_PRODUCERS - gated if impl == "fsg-fp8-nogated" else FP8_PRODUCERS
        train = fsg.compile_step(
            loss_fn, optimizer=fsg.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD),
            precision=fsg.Policy(compute=torch.bfloat16, matmul=matmul),
            fused_loss=False if impl == "fsg-unfused" else None,
            fusions=Fusions(fp8_producers=producers),
        )  # fmt: skip
        state = train.init(fsg.params(model))
        holder = [state]

        def step(i):
            holder[0], metrics = train(holder[0], {"ids": batches[i % 4]})
            return metrics["loss"]

    t0 = time.perf_counter()
    first = float(step(0))
    compile_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(args.warmup + i)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    if args.profile:
        profile_table(step, torch.cuda.synchronize, Path(f"{args.profile}.{kind}.{impl}.txt"))
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "ms": ms,
        "tokens_per_s": args.batch * args.seq / ms * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "compile_s": compile_s,
        "first_loss": first,
        "last_loss": float(loss),
        "n_params": n_params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2,llama")
    parser.add_argument("--impl", default="compile,fsg")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode for the baseline (default: its default)")
    parser.add_argument("--profile", help="a path prefix: write a CUDA-time table of 3 more steps per run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, impl = args.child.split(":")
        print("RESULT " + json.dumps(run(kind, impl, args)), flush=True)
        return
    import torch
    import transformers

    rows = []
    for kind in args.model.split(","):
        for impl in args.impl.split(","):
            print(f"[hf {kind}] {impl} ...", flush=True)
            cmd = [sys.executable, __file__, "--child", f"{kind}:{impl}", *sys.argv[1:]]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", flush=True)
                continue
            rows.append((kind, impl, json.loads(lines[-1][7:])))
            print(f"  {rows[-1][2]}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}, batch {args.batch} x {args.seq}\n")  # fmt: skip
    print("| model | implementation | step (ms) | tokens/s | peak mem (GiB) | first call (s) | loss first -> last |")
    print("|---|---|---|---|---|---|---|")
    for kind, impl, r in rows:
        print(f"| {kind} ({r['n_params'] / 1e6:.0f}M) | {impl} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r['peak_gib']:.2f} | {r['compile_s']:.1f} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")  # fmt: skip
    for kind in args.model.split(","):
        got = {impl: r["ms"] for k, impl, r in rows if k == kind}
        baselines = {impl: ms for impl, ms in got.items() if impl.startswith("compile")}
        if baselines and "fsg" in got:
            best = min(baselines, key=baselines.get)
            print(f"\n{kind}: fsg {baselines[best] / got['fsg']:.3f}x the fastest baseline ({best})")
        for impl in (i for i in got if i.startswith("fsg-fp8") and "fsg" in got):
            print(f"{kind}: {impl} {got['fsg'] / got[impl]:.3f}x fsg (bf16)")


if __name__ == "__main__":
    main()
