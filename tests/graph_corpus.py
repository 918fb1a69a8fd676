"""A corpus of representative steps and their optimized graphs, for refactors that must not
change what a step compiles: ``python -m tests.graph_corpus DIR`` writes each case's
``step.lower(state, batch).as_text()`` to ``DIR/<case>.txt`` (on CPU, nothing runs); dumps
written before and after a change must be equal (``diff -r``).

The cases: examples/gpt.py's tiny GPT in float32, bf16 (fused AdamW, fused loss), FP8
(tensorwise, rowwise, rowwise with FP8 grad-weights), each ``Fusions`` field off on its own, the
CUDA-only passes forced onto CPU graphs, and a gated MLP under rowwise FP8.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import fsg
from fsg._src.passes.options import CUDA_PASSES, Fusions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

TINY_GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BF16 = fsg.Policy(compute=torch.bfloat16)


def fp8(**config) -> fsg.Policy:
    return fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(**config))


class GatedMLP(nn.Module):
    """Llama's MLP, ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int = 32, hidden: int = 64):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(width, hidden), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def optimized_text(policy: fsg.Policy, model: str = "gpt", **compile_kw) -> str:
    """The optimized graph's text of one AdamW step of ``model`` (``"gpt"`` or ``"gated"``, seed 0)
    under ``policy`` and ``compile_kw``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if model == "gpt":
        module = GPT(GPTConfig(**TINY_GPT))
        x = torch.randint(0, 64, (2, 17), generator=g)
        batch = {"x": x[:, :-1], "y": x[:, 1:]}

        def loss_fn(params, batch):
            return fsg.apply(module, params, batch["x"], batch["y"])
    else:
        module = GatedMLP()
        batch = {"x": torch.randn(2, 16, 32, generator=g)}

        def loss_fn(params, batch):
            return fsg.apply(module, params, batch["x"]).float().pow(2).mean()

    step = fsg.compile_step(
        loss_fn, optimizer=fsg.optim.adamw(1e-3), precision=policy, backend="aot_eager", **compile_kw
    )
    return step.lower(step.init(fsg.params(module)), batch).as_text()


CASES: dict[str, Callable[[], str]] = {
    "bf16": lambda: optimized_text(BF16),
    "bf16_fused_adamw": lambda: optimized_text(BF16, fused_optimizer=True),
    "bf16_fused_loss": lambda: optimized_text(BF16, fused_loss=True),
    "fp32": lambda: optimized_text(fsg.Policy()),
    "cpu_gemm_epilogues": lambda: optimized_text(BF16, fusions=Fusions(on_cpu={"gemm_epilogues"})),
    "cpu_gemm_epilogues_fwd": lambda: optimized_text(
        BF16, fusions=Fusions(on_cpu={"gemm_epilogues"}, gemm_epilogue_backward=False)
    ),
    "cpu_batch_casts": lambda: optimized_text(BF16, fusions=Fusions(on_cpu={"batch_casts"})),
    "cpu_pack_attention_grads": lambda: optimized_text(BF16, fusions=Fusions(on_cpu={"pack_attention_grads"})),
    "cpu_all_three": lambda: optimized_text(BF16, fusions=Fusions(on_cpu=CUDA_PASSES)),
    "fp8_tensorwise": lambda: optimized_text(fp8(recipe="tensorwise")),
    "fp8_rowwise": lambda: optimized_text(fp8(recipe="rowwise")),
    "fp8_rowwise_gw": lambda: optimized_text(fp8(recipe="rowwise", grad_weight="fp8")),
    "fp8_rowwise_noweights": lambda: optimized_text(fp8(recipe="rowwise"), fusions=Fusions(fp8_weights=False)),
    "fp8_rowwise_noln": lambda: optimized_text(fp8(recipe="rowwise"), fusions=Fusions(fp8_layer_norms=False)),
    "fp8_rowwise_noadds": lambda: optimized_text(fp8(recipe="rowwise"), fusions=Fusions(fp8_residual_adds=False)),
    "fp8_rowwise_noproducers": lambda: optimized_text(fp8(recipe="rowwise"), fusions=Fusions(fp8_producers=set())),
    "fp8_rowwise_nocolsum": lambda: optimized_text(fp8(recipe="rowwise"), fusions=Fusions(fp8_column_sums=False)),
    "fp8_rowwise_geluback_only": lambda: optimized_text(
        fp8(recipe="rowwise"), fusions=Fusions(fp8_producers={"gelu_backward"})
    ),
    "fp8_rowwise_fused_loss_epilogues": lambda: optimized_text(
        fp8(recipe="rowwise"), fusions=Fusions(on_cpu={"gemm_epilogues", "batch_casts"}), fused_loss=True
    ),
    "fp8_gated": lambda: optimized_text(fp8(recipe="rowwise", keep_output_head=False), "gated"),
    "fp8_gated_nomul": lambda: optimized_text(
        fp8(recipe="rowwise", keep_output_head=False),
        "gated",
        fusions=Fusions(fp8_producers={"gelu_backward", "gelu", "cat"}),
    ),
}


def dump(out: Path) -> None:
    """Writes each case's graph text to ``out/<case>.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, case in CASES.items():
        (out / f"{name}.txt").write_text(case())


if __name__ == "__main__":
    dump(Path(sys.argv[1]))
