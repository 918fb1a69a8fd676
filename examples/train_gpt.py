"""Train a character-level GPT with fsg on text that every machine has: Python's own stdlib.

    python examples/train_gpt.py                      # CPU default: ~2-3 minutes on 2 cores
    python examples/train_gpt.py --device cuda --n-layer 6 --n-embd 384 --block-size 256 --steps 5000
    torchrun --nproc-per-node=4 examples/train_gpt.py --mesh dp=2,tp=2   # sharded, 4 processes

The whole train step (forward, backward, AdamW with warm-up and cosine decay, gradient
clipping) is one compiled graph. Batches come from ``fsg.data.Loader``: a deterministic
sequence of ``[B, T + 1]`` token blocks (the input/target shift is in the loss, so it is
traced into the step), assembled ahead by a background thread; under ``--mesh`` each rank
reads only its own rows. The script prints a progress bar, samples text from the model
every ``--sample-every`` steps, and writes the loss curve to ``OUT/loss.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig  # noqa: E402

import fsg  # noqa: E402
import fsg.data  # noqa: E402

# Stdlib modules whose source is the default corpus: present wherever Python is.
CORPUS_MODULES = [
    "argparse.py", "ast.py", "calendar.py", "collections/__init__.py", "configparser.py",
    "csv.py", "dataclasses.py", "difflib.py", "enum.py", "fractions.py", "functools.py",
    "heapq.py", "inspect.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py",
    "pathlib.py", "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py",
    "subprocess.py", "textwrap.py", "threading.py", "typing.py", "zipfile.py",
]  # fmt: skip


def load_text(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / m).read_text(encoding="utf-8", errors="replace") for m in CORPUS_MODULES if (root / m).exists()]
    if not parts:
        raise SystemExit(f"no stdlib sources found under {root}; pass --data FILE")
    return "\n".join(parts)


class CharData:
    """Characters to ids, a train/validation split, and random validation batches."""

    def __init__(self, text: str, block_size: int, device: torch.device, seed: int):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]
        self.block_size, self.device = block_size, device
        self.generator = torch.Generator().manual_seed(seed)
        counts = torch.tensor(list(Counter(text[:split]).values()), dtype=torch.float64)
        probs = counts / counts.sum()
        self.unigram_entropy = float(-(probs * probs.log()).sum())

    def loader(self, batch_size: int, *, seed: int, mesh=None) -> fsg.data.Loader:
        """The training batches: ``[B, T + 1]`` windows of the train split, each rank its rows."""
        train = fsg.data.Tokens(self.train, name="the train split")
        return fsg.data.Loader(train, batch_size=batch_size, seq_len=self.block_size, seed=seed, mesh=mesh,
                               vocab_size=len(self.chars), device=self.device)  # fmt: skip

    def batch(self, batch_size: int, split: str = "train") -> dict[str, torch.Tensor]:
        ids = self.train if split == "train" else self.val
        starts = torch.randint(len(ids) - self.block_size - 1, (batch_size,), generator=self.generator)
        x_BT = torch.stack([ids[s : s + self.block_size] for s in starts])
        y_BT = torch.stack([ids[s + 1 : s + 1 + self.block_size] for s in starts])
        return {"x": x_BT.to(self.device), "y": y_BT.to(self.device)}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


@torch.no_grad()
def sample(model: GPT, params, data: CharData, prompt: str, n: int, temperature: float = 0.8) -> str:
    ids = torch.tensor([[data.stoi.get(c, 0) for c in prompt]], device=data.device)
    for _ in range(n):
        logits_BTV = fsg.apply(model, params, ids[:, -model.cfg.block_size :])
        probs = torch.softmax(logits_BTV[0, -1].float() / temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1)[None]], dim=1)
    return data.decode(ids[0].tolist())


@torch.no_grad()
def evaluate(model: GPT, params, data: CharData, batch_size: int, batches: int = 8) -> float:
    losses = []
    for _ in range(batches):
        batch = data.batch(batch_size, "val")
        losses.append(float(fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])))
    return sum(losses) / len(losses)


def plot(history: list[tuple[int, float]], val: list[tuple[int, float]], unigram: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*history), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.axhline(unigram, color="gray", ls="--", label=f"unigram baseline ({unigram:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("fsg: character-level GPT on Python's stdlib source")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a UTF-8 text file to train on (default: Python stdlib sources)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (at most a fifth of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sample-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out", help="folder for loss.png")
    p.add_argument("--mesh", help="shard over a device mesh under torchrun, e.g. dp=2,tp=2")
    return p.parse_args(argv)


def parse_mesh(text: str) -> dict[str, int]:
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh takes name=size pairs like dp=2,tp=2; got {text!r}")
        axes[name.strip()] = int(size)
    return axes


def sharding_for(axes: dict[str, int]):
    """FSDP over dp and Megatron tensor parallelism over tp, as the mesh has them."""
    if "dp" in axes and "tp" in axes:
        return fsg.sharding.fsdp_tensor_parallel("dp", "tp")
    if "tp" in axes:
        return fsg.sharding.tensor_parallel("tp")
    return fsg.sharding.fsdp(next(iter(axes)))


def gathered(params):
    """Full parameters on every rank (sharded DTensors are gathered), for eager eval."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in params.items()}


def main(argv=None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    mesh = None
    if args.mesh:
        info = fsg.distributed.initialize(backend="gloo" if args.device == "cpu" else None)
        mesh = fsg.Mesh(parse_mesh(args.mesh), device_type=info.device.type)
        args.device = str(info.device)
    is_main = mesh is None or torch.distributed.get_rank() == 0
    log = print if is_main else (lambda *a, **k: None)
    device = torch.device(args.device)
    data = CharData(load_text(args.data), args.block_size, device, args.seed)
    cfg = GPTConfig(len(data.chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = GPT(cfg).to(device)
    params = fsg.params(model)
    n_params = sum(p.numel() for p in params.values())
    log(f"data: {len(data.train):,} train chars, vocabulary {len(data.chars)}, "
          f"unigram baseline {data.unigram_entropy:.3f} nats/char")  # fmt: skip
    log(f"model: {n_params / 1e6:.2f}M params, {args.n_layer} layers, width {args.n_embd}; device {device}"
        + (f"; {mesh!r}" if mesh else ""))  # fmt: skip

    def loss_fn(params, tokens_BT):  # tokens_BT: [B, T + 1] from the loader; the shift is traced
        logits_BTV = fsg.apply(model, params, tokens_BT[:, :-1])
        return fsg.nn.cross_entropy(logits_BTV, tokens_BT[:, 1:])

    decay_2d = lambda p: {k: v.ndim >= 2 for k, v in p.items()}  # noqa: E731 - no decay of biases/norms
    optimizer = fsg.optim.chain(
        fsg.optim.clip_by_global_norm(1.0),
        fsg.optim.adamw(
            fsg.optim.warmup_cosine(args.lr, warmup=min(args.warmup, args.steps // 5), total=args.steps, end_value=args.lr / 10),
            b2=0.99, weight_decay=args.weight_decay, mask=decay_2d,
        ),
    )  # fmt: skip
    sharding = sharding_for(mesh_axes := parse_mesh(args.mesh)) if mesh else None
    step = fsg.compile_step(loss_fn, mesh, optimizer=optimizer, param_sharding=sharding, backend=args.backend)
    state = step.init(params, seed=args.seed)
    loader = data.loader(args.batch_size, seed=args.seed, mesh=mesh)
    del params  # the state holds its own copy, updated in place

    log(f"compiling the train step with {args.backend} (forward + backward + AdamW in one graph)...")
    t0 = time.perf_counter()
    first = next(loader)
    state, metrics = step(state, first)
    log(f"compiled and ran step 1 in {time.perf_counter() - t0:.1f}s")
    if mesh:
        rows = step.lower(state, first).collectives()
        log(
            f"sharding {mesh_axes}: collectives per step: "
            + ", ".join(f"{r.count} {r.kind} over {r.axis}" for r in rows)
        )

    history, val_history = [(1, float(metrics["loss"]))], []
    bar = tqdm(
        range(2, args.steps + 1),
        initial=1,
        total=args.steps,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not is_main,
    )
    t_train = time.perf_counter()
    for i in bar:
        state, metrics = step(state, next(loader))
        if i % 10 == 0 or i == args.steps:
            loss = float(metrics["loss"])  # a host sync every 10 steps only
            history.append((i, loss))
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{float(metrics['lr']):.1e}")
        evaluating = i % args.eval_every == 0 or i == args.steps
        sampling = i % args.sample_every == 0 or i == args.steps
        if evaluating or sampling:
            full_params = gathered(state.params)  # on a mesh: an all-gather, on every rank
        if evaluating:
            val_history.append((i, evaluate(model, full_params, data, args.batch_size)))
        if sampling and is_main:
            text = sample(model, full_params, data, "def ", 160)
            tqdm.write(f"\n--- sample at step {i} (val loss {val_history[-1][1]:.3f}) ---\n{text}\n")
    elapsed = time.perf_counter() - t_train
    bar.close()
    loader.close()

    out = Path(args.out)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        plot(history, val_history, data.unigram_entropy, out / "loss.png")
    final_val = val_history[-1][1] if val_history else math.nan
    tokens = (args.steps - 1) * args.batch_size * args.block_size
    log(f"done: train loss {history[-1][1]:.3f}, validation loss {final_val:.3f} nats/char "
          f"(unigram baseline {data.unigram_entropy:.3f}); {tokens / elapsed:,.0f} chars/s; "
          f"loss curve in {out / 'loss.png'}")  # fmt: skip
    return {"train_loss": history[-1][1], "val_loss": final_val, "unigram": data.unigram_entropy}


if __name__ == "__main__":
    main()
