"""A GPT-style model's collectives per step on a ``dp x fsdp x tp x pp`` mesh, estimated from
its config, for clusters no one can lower a step on.

Per step (one micro-batch, bf16 compute, fp32 gradients reduced):
- ``tp`` (Megatron tensor parallel with sequence parallelism): per layer two all-gathers and
  two reduce-scatters of the layer's activations forward and again backward; in bytes, four
  all-reduces of ``tokens_per_replica x d_model`` bf16 values per layer;
- ``fsdp`` (ZeRO-3): the parameters gathered forward and again backward (bf16), the gradients
  reduce-scattered (fp32), one collective per layer each;
- ``dp``: the gradient (or, with ``fsdp``, its shard) all-reduced, one bucket per layer;
- ``pp`` (1F1B, ``fsg.Pipeline``'s default): each rank holds ``layers / pp`` layers (and that
  share of the parameters, the collectives above scaled to it); each microbatch's activations
  (bf16, split over ``tp`` by sequence parallelism) cross each stage boundary forward and their
  gradients backward, point to point (``send_recv``). A replica's batch goes in microbatches of
  ``micro_batch`` sequences; the schedule's bubble, ``(pp - 1) / (m + pp - 1)`` of the step for
  ``m`` microbatches, stretches the compute time.

Compute time is ``6 x params x tokens`` plus attention (``12 x layers x d_model x seq`` per
token), at ``mfu`` of the GPU's peak. Memory per GPU: AdamW state at 16 bytes per parameter
over ``tp x fsdp x pp``, and activations at 34 bytes per token x d_model per layer over ``tp``
(Korthikanti et al. 2022, selective recomputation with sequence parallelism); with ``pp``, a
stage's ``layers / pp`` layers for the ``min(m, pp)`` microbatches 1F1B keeps in flight on the
first stage (the most).
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
    micro_batch: int = 1  # sequences per pipeline microbatch (pp > 1)

    @property
    def num_params(self) -> int:
        return 12 * self.layers * self.d_model**2 + self.vocab * self.d_model

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    def check_mesh(self, axes: dict) -> str | None:
        """Why this mesh cannot run the model (``None`` when it can)."""
        unknown = [a for a in axes if a not in ("dp", "fsdp", "tp", "pp")]
        if unknown:
            return f"axis {unknown[0]!r} is not modelled (dp, fsdp, tp, pp)"
        tp, replicas, pp = axes.get("tp", 1), axes.get("dp", 1) * axes.get("fsdp", 1), axes.get("pp", 1)
        if self.heads % tp:
            return f"{self.heads} heads do not divide over tp={tp}"
        if self.global_batch % replicas:
            return f"the batch of {self.global_batch} sequences does not divide over dp x fsdp = {replicas}"
        if self.layers % pp:
            return f"{self.layers} layers do not divide into pp={pp} stages"
        if pp > 1 and self.microbatches(axes) < pp:
            return f"{self.microbatches(axes)} microbatches per replica are fewer than pp={pp} (1F1B needs pp)"
        need = self.memory_per_gpu(axes)
        if need > 0.9 * self.memory_GB * 1e9:
            return f"needs {need / 1e9:.0f} GB per GPU (> 90% of {self.memory_GB:.0f} GB)"
        return None

    def microbatches(self, axes: dict) -> int:
        """A replica's pipeline microbatches per step (1 without ``pp``)."""
        if axes.get("pp", 1) == 1:
            return 1
        return max(1, self.global_batch // (axes.get("dp", 1) * axes.get("fsdp", 1) * self.micro_batch))

    def bubble(self, axes: dict) -> float:
        """1F1B's idle fraction of the step: ``(pp - 1) / (m + pp - 1)``."""
        pp = axes.get("pp", 1)
        return (pp - 1) / (self.microbatches(axes) + pp - 1)

    def memory_per_gpu(self, axes: dict) -> float:
        tp, fsdp, pp = axes.get("tp", 1), axes.get("fsdp", 1), axes.get("pp", 1)
        tokens_local = self.tokens / (axes.get("dp", 1) * fsdp)
        state = 16 * self.num_params / (tp * fsdp * pp)
        m = self.microbatches(axes)
        in_flight = tokens_local / m * min(m, pp)  # the first stage's, at 1F1B's peak
        activations = 34 * in_flight * self.d_model * (self.layers / pp) / tp
        return state + activations

    def compute_s(self, world: int, axes: dict | None = None) -> float:
        """The step's compute at ``mfu``, stretched by the pipeline's bubble on a mesh with ``pp``."""
        flops = (6 * self.num_params + 12 * self.layers * self.d_model * self.seq_len) * self.tokens
        return flops / (world * self.peak_tflops * 1e12 * self.mfu) / (1.0 - self.bubble(axes or {}))

    def collectives(self, axes: dict) -> list[tuple[str, str, int, int]]:
        """Rows ``(kind, axis, bytes, count)`` per rank per step, as ``Lowered.collectives()``
        lists them (``bytes``: the inputs' total; an all-gather's input is its shard)."""
        why = self.check_mesh(axes)
        if why is not None and "not modelled" in why:
            raise TopologyError(f"{self.name}: {why}")
        tp, fsdp, dp, pp = axes.get("tp", 1), axes.get("fsdp", 1), axes.get("dp", 1), axes.get("pp", 1)
        params_tp = self.num_params / (tp * pp)  # this rank's stage's share
        layers = self.layers // pp
        act = self.tokens / (dp * fsdp) * self.d_model * 2  # a replica's activations, bf16, per layer
        rows = []
        if tp > 1:
            rows.append(("all_reduce", "tp", int(4 * layers * act), 4 * layers))
        if fsdp > 1:
            rows.append(("all_gather_into_tensor", "fsdp", int(2 * params_tp / fsdp * 2), 2 * layers))
            rows.append(("reduce_scatter_tensor", "fsdp", int(params_tp * 4), layers))
        if dp > 1:
            rows.append(("all_reduce", "dp", int(params_tp / fsdp * 4), layers))
        if pp > 1:  # every microbatch's activations forward and gradients backward, over tp's shards
            rows.append(("send_recv", "pp", int(2 * act / tp), 2 * self.microbatches(axes)))
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
