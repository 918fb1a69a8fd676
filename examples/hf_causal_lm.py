"""Train a Hugging Face causal LM (GPT-2 or Llama, built from a config: no download) with fsg.

    pip install transformers
    python examples/hf_causal_lm.py                          # small Llama on CPU, ~1-2 minutes
    python examples/hf_causal_lm.py --model gpt2 --dropout 0.1
    python examples/hf_causal_lm.py --device cuda --layers 12 --width 768 --heads 12 --kv-heads 4 --seq 1024
    torchrun --nproc-per-node=4 examples/hf_causal_lm.py --mesh dp=2,tp=2 --steps 40   # CPU: gloo

The model is an unchanged `transformers` module; `fsg.apply` runs it on the params of the
train state, and its own loss (`labels=`) is the loss. The text is Python's stdlib source as
bytes (256 tokens), so it needs no tokenizer and no network. With `--dropout`, dropout masks
come from the train state's random key: the same `--seed` gives the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_gpt import load_text, parse_mesh  # noqa: E402

import fsg  # noqa: E402

# GPT-2 keeps its projections in Conv1D layers, whose weights are stored [in, out]: column
# parallel is P(None, "tp") there, row parallel P("tp", None) (Llama's nn.Linear names are in
# fsg.sharding's defaults).
GPT2_TP = [
    (r".*\.(c_attn|c_fc)\.weight", fsg.P(None, "tp")),
    (r".*\.(c_attn|c_fc)\.bias", fsg.P("tp")),
    (r".*\.c_proj\.weight", fsg.P("tp", None)),
]


def make_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.model == "gpt2":
        config = GPT2Config(
            vocab_size=256, n_positions=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width,
            resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=256, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        attention_dropout=args.dropout, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def sharding_for(model: str, axes: dict[str, int]):
    if "tp" not in axes:
        return fsg.sharding.fsdp(next(iter(axes)))
    if model == "gpt2":
        tp = fsg.sharding.rules(GPT2_TP)
        return tp + fsg.sharding.fsdp("dp") if "dp" in axes else tp
    return fsg.sharding.fsdp_tensor_parallel("dp", "tp") if "dp" in axes else fsg.sharding.tensor_parallel("tp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="Llama's key-value heads (grouped-query attention)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--mesh", help="shard over a device mesh under torchrun, e.g. dp=2,tp=2")
    return p.parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    mesh = None
    if args.mesh:
        info = fsg.distributed.initialize(backend="gloo" if args.device == "cpu" else None)
        mesh = fsg.Mesh(parse_mesh(args.mesh), device_type=info.device.type)
    device = torch.device(args.device if mesh is None else mesh.device_type)
    is_main = mesh is None or torch.distributed.get_rank() == 0
    data = torch.tensor(list(load_text(None).encode("utf-8")), dtype=torch.long)
    model = make_model(args).to(device)

    def loss_fn(params, batch):
        return fsg.apply(model, params, input_ids=batch["ids"], labels=batch["ids"]).loss

    step = fsg.compile_step(
        loss_fn, mesh, optimizer=fsg.optim.adamw(args.lr, b2=0.95, weight_decay=0.1), backend=args.backend,
        param_sharding=sharding_for(args.model, parse_mesh(args.mesh)) if mesh else None,
        batch_sharding=fsg.P("dp") if mesh and "dp" in mesh.axis_names else None,
    )  # fmt: skip
    state = step.init(fsg.params(model), seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)  # the same batches on every rank (the step slices them)
    n = sum(p.numel() for p in model.parameters())
    if is_main:
        print(f"{args.model}: {n / 1e6:.2f}M params, {len(data):,} bytes of text; compiling the step...", flush=True)
    losses, t0 = [], time.perf_counter()
    for i in range(args.steps):
        starts = torch.randint(len(data) - args.seq, (args.batch_size,), generator=g)
        batch = {"ids": torch.stack([data[s : s + args.seq] for s in starts]).to(device)}
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if is_main and (i == 0 or (i + 1) % 25 == 0 or i + 1 == args.steps):
            print(f"step {i + 1:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if is_main:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (uniform over bytes: {torch.tensor(256.0).log():.3f})")
    return losses


if __name__ == "__main__":
    main()
