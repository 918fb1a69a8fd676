"""Train a character-level GPT with fsg on text that every machine has: Python's own stdlib.

    python examples/train_gpt.py                      # CPU default: ~80 s on 2 idle cores
    python examples/train_gpt.py --device cuda --n-layer 6 --n-embd 384 --block-size 256 --steps 5000
    torchrun --nproc-per-node=4 examples/train_gpt.py --mesh dp=2,tp=2   # sharded, 4 processes
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node=2 --max-restarts=3 \
        examples/train_gpt.py --mesh dp=2 --checkpoint-dir ckpt   # resumes after a crash

The whole train step (forward, backward, AdamW with warm-up and cosine decay, gradient
clipping) is one compiled graph. Batches come from ``fsg.data.Loader``: a deterministic
sequence of ``[B, T + 1]`` token blocks (the input/target shift is in the loss, so it is
traced into the step), assembled ahead by a background thread; under ``--mesh`` each rank
reads only its own rows. The script prints a progress bar (plain lines when stdout is not a
terminal), writes every step's metrics to ``OUT/metrics.jsonl``, samples text from the model
every ``--sample-every`` steps, and writes the loss curve to ``OUT/loss.png``. Under torchrun,
rank 0 prints and rank r > 0 writes ``OUT/rank{r}.log``.

With ``--checkpoint-dir`` it saves the train state and the loader's position together every
``--save-every`` steps and at the end, and a run started (or restarted by ``torchrun
--max-restarts``) resumes from the latest complete checkpoint: the same batches and random
keys, so the same losses (docs/resilience.md, "Resuming a run").
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig  # noqa: E402
from run_log import RunLog, peak_flops, read_metrics  # noqa: E402

import fsg  # noqa: E402
import fsg.data  # noqa: E402

# Stdlib modules whose source is the default corpus: present wherever Python is.
CORPUS_MODULES = [
    "argparse.py",
    "ast.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "pprint.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "zipfile.py",
]


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
        return fsg.data.Loader(
            train,
            batch_size=batch_size,
            seq_len=self.block_size,
            seed=seed,
            mesh=mesh,
            vocab_size=len(self.chars),
            device=self.device,
        )

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
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "muon"],
        help="muon: Muon for the blocks' weight matrices, AdamW for the rest",
    )
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon's peak learning rate (--optimizer muon)")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--threads", type=int, help="CPU threads a kernel runs on (default: the cores not busy with other work)"
    )
    p.add_argument("--sample-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out", help="folder for loss.png, metrics.jsonl and the rank logs")
    p.add_argument("--metrics-file", help="per-step metrics, one JSON object a line (default: OUT/metrics.jsonl)")
    p.add_argument("--log-every", type=int, default=10, help="steps between host syncs that log the held metrics")
    p.add_argument(
        "--checkpoint-dir", help="save here and resume from the latest checkpoint in it (default: no checkpoints)"
    )
    p.add_argument("--save-every", type=int, default=200, help="steps between checkpoints (and one at the end)")
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


def resume(manager, state, loader, log):
    """The train state and the loader's position from the latest complete checkpoint, if any."""
    latest = manager.latest() if manager is not None else None  # waits for a save in flight
    if latest is None:
        return state, 0
    saved = manager.restore(latest, like={"train": state, "data": loader.state_dict()})
    loader.restore(saved["data"])
    log(
        f"resumed from {manager.step_dir(latest)}: step {int(saved['train'].step)}, "
        f"data epoch {loader.epoch} position {loader.position}"
    )
    return saved["train"], int(saved["train"].step)


def make_optimizer(args: argparse.Namespace) -> fsg.optim.GradientTransformation:
    """AdamW (no decay of biases and norms); with ``--optimizer muon``, Muon for the blocks'
    weight matrices and AdamW for the embeddings, biases and norms (docs/optimizers.md)."""

    def schedule(peak: float) -> fsg.optim.Schedule:
        return fsg.optim.warmup_cosine(
            peak, warmup=min(args.warmup, args.steps // 5), total=args.steps, end_value=peak / 10
        )

    if args.optimizer == "adamw":
        decay_2d = lambda p: {k: v.ndim >= 2 for k, v in p.items()}  # noqa: E731 - no decay of biases/norms
        return fsg.optim.adamw(schedule(args.lr), b2=0.99, weight_decay=args.weight_decay, mask=decay_2d)

    def groups(p: dict) -> dict:
        return {
            k: "muon" if v.ndim == 2 and k.startswith("blocks.") else "decay" if v.ndim == 2 else "no_decay"
            for k, v in p.items()
        }

    return fsg.optim.multi_transform(
        {
            "muon": fsg.optim.muon(schedule(args.muon_lr), weight_decay=args.weight_decay),
            "decay": fsg.optim.adamw(schedule(args.lr), b2=0.99, weight_decay=args.weight_decay),
            "no_decay": fsg.optim.adamw(schedule(args.lr), b2=0.99, weight_decay=0.0),
        },
        groups,
    )


def cpu_threads(requested: int | None) -> tuple[int, str]:
    """The intra-op thread count for a CPU run, and where it came from: ``--threads`` if given;
    torch's own count where ``OMP_NUM_THREADS`` is set (torchrun sets it to 1 for several ranks);
    else the cores this process may run on less those other processes keep busy (the 1-minute
    load average), at least one and at most torch's default (the physical cores).

    Why not every core: at this model's size each Inductor CPU kernel is a short parallel loop
    ending in a barrier that all its threads must reach. A thread whose core another process
    holds is descheduled, and the others wait for it a scheduler tick, kernel after kernel: on
    busy cores two threads ran slower than one, on idle cores faster (benchmarks/RESULTS.md,
    "CPU: the example's thread count").
    """
    if requested:
        return requested, "--threads"
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = max(1, min(cores, torch.get_num_threads(), round(cores - busy)))
    return threads, f"{cores} cores, load average {busy:.1f}; --threads to choose"


def main(argv=None) -> dict:
    """Trains as the flags say and returns the losses; leaves the caller's thread count as it was."""
    args = parse_args(argv)
    threads_before = torch.get_num_threads()
    try:
        return train(args)
    finally:
        torch.set_num_threads(threads_before)


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    mesh = None
    if args.mesh:
        info = fsg.distributed.initialize(backend="gloo" if args.device == "cpu" else None)
        mesh = fsg.Mesh(parse_mesh(args.mesh), device_type=info.device.type)
        args.device = str(info.device)
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if mesh else (0, 1)
    is_main = rank == 0
    out = Path(args.out)
    device = torch.device(args.device)
    threads = ""
    if device.type == "cpu":  # before the compile: Inductor's CPU kernels keep the count they were built with
        n, why = cpu_threads(args.threads)
        torch.set_num_threads(n)
        threads = f", {n} thread{'s' if n > 1 else ''} ({why})"
    data = CharData(load_text(args.data), args.block_size, device, args.seed)
    cfg = GPTConfig(len(data.chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = GPT(cfg).to(device)
    params = fsg.params(model)
    n_params = sum(p.numel() for p in params.values())

    def loss_fn(params, tokens_BT):  # tokens_BT: [B, T + 1] from the loader; the shift is traced
        logits_BTV = fsg.apply(model, params, tokens_BT[:, :-1])
        return fsg.nn.cross_entropy(logits_BTV, tokens_BT[:, 1:])

    optimizer = fsg.optim.chain(fsg.optim.clip_by_global_norm(1.0), make_optimizer(args))
    sharding = sharding_for(mesh_axes := parse_mesh(args.mesh)) if mesh else None
    step = fsg.compile_step(loss_fn, mesh, optimizer=optimizer, param_sharding=sharding, backend=args.backend)
    state = step.init(params, seed=args.seed)
    loader = data.loader(args.batch_size, seed=args.seed, mesh=mesh)
    del params  # the state holds its own copy, updated in place
    manager = None
    if args.checkpoint_dir:  # after initialize(): its exit hook then flushes before the group goes
        manager = fsg.checkpoint.CheckpointManager(
            args.checkpoint_dir, max_to_keep=2, save_interval_steps=args.save_every
        )
    pre_log: list[str] = []
    state, start = resume(manager, state, loader, pre_log.append)

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    metrics_file = Path(args.metrics_file) if args.metrics_file else out / "metrics.jsonl"
    run = RunLog(
        out,
        rank=rank,
        total_steps=args.steps,
        start_step=start,
        metrics_file=metrics_file,
        tokens_per_step=args.batch_size * args.block_size,
        flush_every=args.log_every,
        extra={"attempt": attempt} if "TORCHELASTIC_RESTART_COUNT" in os.environ else None,
    )
    log = run.print
    log(
        f"data: {len(data.train):,} train chars, vocabulary {len(data.chars)}, "
        f"unigram baseline {data.unigram_entropy:.3f} nats/char"
    )
    log(
        f"model: {n_params / 1e6:.2f}M params, {args.n_layer} layers, width {args.n_embd}; device {device}{threads}"
        + (f"; {mesh!r}" if mesh else "")
    )
    for line in pre_log:
        log(line)

    val_history, trained, elapsed = [], 0, 0.0
    for i in range(start + 1, args.steps + 1):
        batch = next(loader)
        if i == start + 1:
            update = "Muon and AdamW" if args.optimizer == "muon" else "AdamW"
            log(f"compiling the step (first call: forward + backward + {update} as one graph, {args.backend})...")
            t0 = time.perf_counter()
        state, metrics = step(state, batch)
        if i == start + 1:
            log(f"compiled in {time.perf_counter() - t0:.1f}s (step {i} included); training, timed from here:")
            if mesh:
                rows = step.lower(state, batch).collectives()
                log(
                    f"sharding {mesh_axes}: collectives per step: "
                    + ", ".join(f"{r.count} {r.kind} over {r.axis}" for r in rows)
                )
            if (peak := peak_flops(device)) is not None:
                run.flops_per_step, run.peak = step.lower(state, batch).cost().flops, peak  # per device
            t_train = time.perf_counter()
        run.step(i, metrics)
        if i == start + 1:
            run.restart_clock()  # the compile is not training time
        if manager is not None and (i % args.save_every == 0 or i == args.steps):
            manager.save(i, {"train": state, "data": loader.state_dict()}, force=True)  # async: returns at once
        evaluating = i % args.eval_every == 0 or i == args.steps
        sampling = i % args.sample_every == 0 or i == args.steps
        if evaluating or sampling:
            full_params = gathered(state.params)  # on a mesh: an all-gather, on every rank
        if evaluating:
            val_history.append((i, evaluate(model, full_params, data, args.batch_size)))
        if sampling and is_main:
            log(
                f"\n--- sample at step {i} (val loss {val_history[-1][1]:.3f}) ---\n{sample(model, full_params, data, 'def ', 160)}\n"
            )
        if evaluating or sampling:
            run.restart_clock()
        trained, elapsed = i - start, time.perf_counter() - t_train
    run.flush()
    loader.close()
    if manager is not None:
        manager.close()  # the last save completes before the report

    if not trained:
        log(f"the checkpoint of step {start} is already the last step (--steps {args.steps}): nothing to train")
        val_history.append((start, evaluate(model, gathered(state.params), data, args.batch_size)))
    losses = {s: r["loss"] for s, r in read_metrics(metrics_file).items()} if is_main else {}
    if is_main:  # the whole run's curve, including the steps of earlier attempts
        plot(list(losses.items()), val_history, data.unigram_entropy, out / "loss.png")
    train_loss = run.records[-1]["loss"] if run.records else losses.get(start, math.nan)
    final_val = val_history[-1][1]
    speed = f"; {(trained - 1) * args.batch_size * args.block_size / elapsed:,.0f} chars/s" if trained > 1 else ""
    log(
        f"done: train loss {train_loss:.3f}, validation loss {final_val:.3f} nats/char "
        f"(unigram baseline {data.unigram_entropy:.3f}){speed}; loss curve in {out / 'loss.png'}, "
        f"metrics in {metrics_file}"
    )
    run.close()
    return {
        "train_loss": train_loss,
        "val_loss": final_val,
        "unigram": data.unigram_entropy,
        "start_step": start,
        "losses": losses,
    }


if __name__ == "__main__":
    main()
