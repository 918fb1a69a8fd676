"""A GPT-style model's collectives per step on a ``dp x fsdp x tp`` mesh, estimated from its
config, for clusters no one can lower a step on.

Per step (one micro-batch, bf16 compute, fp32 gradients reduced):
- ``tp`` (Megatron tensor parallel with sequence parallelism): per layer two all-gathers and
  two reduce-scatters of the layer's activations forward and again backward; in bytes, four
  all-reduces of ``tokens_per_replica x d_model`` bf16 values per layer;
- ``fsdp`` (ZeRO-3): the parameters gathered forward and again backward (bf16), the gradients
  reduce-scattered (fp32), one collective per layer each;
- ``dp``: the gradient (or, with ``fsdp``, its shard) all-reduced, one bucket per layer.

Compute time is ``6 x params x tokens`` plus attention (``12 x layers x d_model x seq`` per
token), at ``mfu`` of the GPU's peak. Memory per GPU: AdamW state at 16 bytes per parameter
over ``tp x fsdp``, and activations at 34 bytes per token x d_model per layer over ``tp``
(Korthikanti et al. 2022, selective recomputation with sequence parallelism).
"""

from __future__ import annotations

from typing import NamedTuple

from fsg._src.errors import TopologyError


class GPTConfig(NamedTuple):
    """A GPT-class model and its global batch.

    Example:
      >>> cfg = PRESETS["gpt-175b"]
      >>> round(cfg.num_params / 1e9)
      175
    """

    name: str
    layers: int
    d_model: int
    heads: int
    vocab: int = 50_304
    seq_len: int = 2048
    global_batch: int = 5000  # sequences per step
    peak_tflops: float = 989.0  # H200 dense bf16
    mfu: float = 0.4
    memory_GB: float = 141.0

    @property
    def num_params(self) -> int:
        return 12 * self.layers * self.d_model**2 + self.vocab * self.d_model

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    def check_mesh(self, axes: dict) -> str | None:
        """Why this mesh cannot run the model (``None`` when it can)."""
        unknown = [a for a in axes if a not in ("dp", "fsdp", "tp")]
        if unknown:
            return f"axis {unknown[0]!r} is not modelled (dp, fsdp, tp)"
        tp, replicas = axes.get("tp", 1), axes.get("dp", 1) * axes.get("fsdp", 1)
        if self.heads % tp:
            return f"{self.heads} heads do not divide over tp={tp}"
        if self.global_batch % replicas:
            return f"the batch of {self.global_batch} sequences does not divide over dp x fsdp = {replicas}"
        need = self.memory_per_gpu(axes)
        if need > 0.9 * self.memory_GB * 1e9:
            return f"needs {need / 1e9:.0f} GB per GPU (> 90% of {self.memory_GB:.0f} GB)"
        return None

    def memory_per_gpu(self, axes: dict) -> float:
        tp, fsdp = axes.get("tp", 1), axes.get("fsdp", 1)
        tokens_local = self.tokens / (axes.get("dp", 1) * fsdp)
        state = 16 * self.num_params / (tp * fsdp)
        activations = 34 * tokens_local * self.d_model * self.layers / tp
        return state + activations

    def compute_s(self, world: int) -> float:
        flops = (6 * self.num_params + 12 * self.layers * self.d_model * self.seq_len) * self.tokens
        return flops / (world * self.peak_tflops * 1e12 * self.mfu)

    def collectives(self, axes: dict) -> list[tuple[str, str, int, int]]:
        """Rows ``(kind, axis, bytes, count)`` per rank per step, as ``Lowered.collectives()``
        lists them (``bytes``: the inputs' total; an all-gather's input is its shard)."""
        why = self.check_mesh(axes)
        if why is not None and "not modelled" in why:
            raise TopologyError(f"{self.name}: {why}")
        tp, fsdp, dp = axes.get("tp", 1), axes.get("fsdp", 1), axes.get("dp", 1)
        params_tp = self.num_params / tp
        rows = []
        if tp > 1:
            act = self.tokens / (dp * fsdp) * self.d_model * 2
            rows.append(("all_reduce", "tp", int(4 * self.layers * act), 4 * self.layers))
        if fsdp > 1:
            rows.append(("all_gather_into_tensor", "fsdp", int(2 * params_tp / fsdp * 2), 2 * self.layers))
            rows.append(("reduce_scatter_tensor", "fsdp", int(params_tp * 4), self.layers))
        if dp > 1:
            rows.append(("all_reduce", "dp", int(params_tp / fsdp * 4), self.layers))
        return rows


PRESETS = {
    "gpt-175b": GPTConfig("gpt-175b", layers=96, d_model=12288, heads=96),
    "gpt-70b": GPTConfig("gpt-70b", layers=80, d_model=8192, heads=64),
    "gpt-7b": GPTConfig("gpt-7b", layers=32, d_model=4096, heads=32),
    "gpt-1b": GPTConfig("gpt-1b", layers=24, d_model=2048, heads=16, global_batch=512),
}


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise TopologyError(f"--model {name!r} is not a preset; presets are {sorted(PRESETS)}")
    return PRESETS[name]
