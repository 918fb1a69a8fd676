"""``Lowered.memory()`` against ``torch.cuda.max_memory_allocated`` on a GPT-2 124M step.

Prints one markdown row per configuration: the static counts, and the step's measured peak
above the resting state (state, batch and last metrics allocated), on the second call (the
first compiles). The table in docs/compiling.md#memory came from one H200:
``python benchmarks/memory.py`` (about 2.5 minutes per loss).
Usage: python benchmarks/memory.py [plain|fused ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

import fsg  # noqa: E402
from fsg._src.kernels._common import plain_math  # noqa: E402

MiB = 2**20


def row(loss: str, backend: str, bf16: bool, accum: int, B: int = 8, T: int = 1024) -> str:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=T, n_layer=12, n_head=12, n_embd=768, bias=False)
    model = GPT(cfg).cuda()

    def loss_fn(params, batch):
        if loss == "plain":  # torch's own ops: the logits are in the graph
            with plain_math():
                logits = fsg.apply(model, params, batch["x"])
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())
        return fsg.apply(model, params, batch["x"], batch["y"])  # fused linear_cross_entropy

    precision = fsg.Policy(compute=torch.bfloat16) if bf16 else fsg.Policy()
    step = fsg.compile_step(
        loss_fn, optimizer=fsg.optim.adamw(1e-4, weight_decay=0.1), backend=backend, precision=precision,
        accum_steps=accum, cuda_graph=False,
    )  # fmt: skip
    state = step.init(fsg.params(model))
    for p in model.parameters():  # the module is only a template now
        p.data = torch.empty(0, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), device="cuda")
    batch = {"x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}
    t0 = time.perf_counter()
    memory = step.lower(state, batch).memory()
    seconds = time.perf_counter() - t0
    state, metrics = step(state, batch)
    torch.cuda.synchronize()
    del metrics
    resting = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state, metrics = step(state, batch)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - resting
    del step, state, metrics
    torch.cuda.empty_cache()
    m = memory
    return (
        f"| {loss} | {backend} | {'bf16' if bf16 else 'float32'} | {accum} | {m.state / MiB:.0f} | "
        f"{m.activations / MiB:.0f} | {m.temporaries_peak / MiB:.0f} | {measured / MiB:.0f} | "
        f"{measured / m.temporaries_peak:.2f} | {seconds:.1f} s |"
    )


if __name__ == "__main__":
    print("| loss | backend | compute | accum | state MiB | activations MiB | temporaries_peak MiB | measured MiB | measured / static | lower + memory() |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for loss in sys.argv[1:] or ["plain", "fused"]:
        for backend, bf16, accum in [("eager", False, 1), ("eager", True, 1), ("inductor", False, 1),
                                     ("inductor", True, 1), ("eager", False, 2), ("inductor", True, 2)]:  # fmt: skip
            print(row(loss, backend, bf16, accum), flush=True)
