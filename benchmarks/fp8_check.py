"""FP8 numerics at GPT-2 shapes: causality and gradient fidelity of each recipe on one GPU.

    python benchmarks/fp8_check.py                       # GPT-2 124M widths, 2 layers, 16 x 1024
    python benchmarks/fp8_check.py --layers 12           # the whole 124M model

The CPU tests (tests/test_float8.py) check both properties on a small model through torch's
reference ``_scaled_mm``; this runs them where the GPU curves were measured: cuBLASLt's and
the rowwise CUTLASS kernel's scale layouts, Inductor's fused casts, the fused head + loss
(``fsg.nn.linear_cross_entropy``), batch 16 x 1024 at GPT-2 124M's widths.

1. **Causality.** The first step's loss over positions 0..31 of sequence 0 (every other target
   ``-100``, ignored) from a batch, and from the same batch with every other token redrawn: a
   recipe whose outputs for a token depend only on that token and the ones before it gives
   the same loss bit for bit. Tensorwise, whose one scale sees every token, is expected to
   differ by a rounding; bf16 and rowwise must not differ at all.
2. **Gradients.** One SGD step (lr 1, so the update is the gradient) of each recipe and of a
   float32 reference (TF32 off) from the same weights and batch: per parameter the cosine and
   the norm ratio of the recipe's gradient against the reference's. A scale applied with the
   wrong layout or value shows as a ratio away from 1 or a cosine far below bf16's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fsg  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

POLICIES = {
    "float32": fsg.Policy(compute=torch.float32),
    "bf16": fsg.Policy(compute=torch.bfloat16),
    "fp8-tensorwise": fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8()),
    "fp8-rowwise": fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise")),
}


def batches(batch: int, seq: int, vocab: int, device: str):
    """A batch, and the same batch with everything but positions 0..31 of sequence 0 redrawn
    (the targets of both ignore every position but those); and the batch with every target."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    other = torch.randint(0, vocab, (batch, seq), generator=g)
    other[0, :32] = x[0, :32]
    y = torch.full((batch, seq), -100)
    y[0, :32] = (3 * x[0, :32] + 1) % vocab
    full = (3 * x + 1) % vocab  # every target seen: the gradient check
    return [{"x": t.to(device), "y": u.to(device)} for t, u in ((x, y), (other, y), (x, full))]


def run(model, init, policy, data):
    """The first step's loss on each batch of ``data`` and its gradients (the SGD update at lr
    1) from the same initial weights: one compiled step, called on each."""
    step = fsg.compile_step(
        lambda p, b: fsg.apply(model, p, b["x"], b["y"]), optimizer=fsg.optim.sgd(1.0), precision=policy, donate=False
    )
    state = step.init({k: v.clone() for k, v in init.items()})
    results = []
    for batch in data:
        new, metrics = step(state, batch)
        grads = {k: (state.params[k] - new.params[k]).double() for k in init}
        results.append((metrics["loss"].clone(), grads))
    assert step.num_compiles == 1, step.num_compiles
    return results, step.lower(state, data[0]).op_counts().get("aten._scaled_mm", 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (torch's reference FP8 kernels)")
    p.add_argument("--json", default="", help="write the figures here too")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=args.layers, n_head=12, n_embd=args.width)
    torch.manual_seed(0)
    model = GPT(cfg).to(args.device)
    init = fsg.params(model)
    a, b, full = batches(args.batch, args.seq, cfg.vocab_size, args.device)
    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "causal": {},
        "grads": {},
    }
    ref = None
    print("| recipe | loss | loss, other tokens redrawn | bit-equal | scaled_mm |")
    print("|---|---|---|---|---|")
    for name, policy in POLICIES.items():
        [(loss_a, _), (loss_b, _), (_, grads)], n_fp8 = run(model, init, policy, [a, b, full])
        same = bool(torch.equal(loss_a, loss_b))
        out["causal"][name] = {"loss": float(loss_a), "loss_other": float(loss_b), "equal": same, "scaled_mm": n_fp8}
        print(f"| {name} | {float(loss_a):.6f} | {float(loss_b):.6f} | {same} | {n_fp8} |")
        if name == "float32":
            ref = grads
            continue
        rows = {}
        for k, g in grads.items():
            r = ref[k]
            cos = float((g * r).sum() / (g.norm() * r.norm()).clamp_min(1e-300))
            rows[k] = (cos, float(g.norm() / r.norm().clamp_min(1e-300)))
        out["grads"][name] = rows
    print()
    print("| parameter | " + " | ".join(f"{n} cos / norm ratio" for n in out["grads"]) + " |")
    print("|---|" + "---|" * len(out["grads"]))
    for k in ref:
        cells = [f"{out['grads'][n][k][0]:.5f} / {out['grads'][n][k][1]:.4f}" for n in out["grads"]]
        print(f"| {k} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
