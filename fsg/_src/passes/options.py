"""``Fusions``: every switch that changes which fused kernels a compiled step runs, as data.

One frozen object, fixed when a step is made (``compile_step(..., fusions=...)``, experimental:
docs/compiling.md#fusions), carried through stage 3 (``pipeline.Options.fusions``, read by each
pass's ``applies`` and by the float8 pass's fusions) and stage 4 (``backend/column_sums.py``);
its ``tag()`` joins Inductor's cache key, so a compile under other fusions is never reused. The
defaults are what a step runs unless told otherwise: each fusion measured faster where it
applies (benchmarks/RESULTS.md). A field turned off is the A/B baseline that
``benchmarks/gpt.py``'s implementations time, and what the tests compare a fused step with.
"""

from __future__ import annotations

import dataclasses

from fsg._src.errors import ArgumentError

# the float8 pass's rowwise producers a cast can be computed in (``passes/float8/producers.py``):
# a GELU's gradient, a GELU, a concatenation of row pieces, a gated MLP's product, a SiLU's gradient
FP8_PRODUCERS = frozenset({"gelu_backward", "gelu", "cat", "mul", "silu_backward"})
# the passes that rewrite only CUDA graphs unless named in ``on_cpu``
CUDA_PASSES = frozenset({"pack_attention_grads", "gemm_epilogues", "batch_casts"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fusions:
    """Which fusions a step's graph passes and compiler apply (each where its pattern matches).

    Args:
      pack_attention_grads: a cuDNN attention backward writes ``dq, dk, dv`` into their qkv
        concatenation (``passes/pack_attention_grads.py``).
      gemm_epilogues: a tanh GELU fed by a bias ``addmm`` or ``mm`` in cuBLASLt's epilogue
        (``passes/gemm_epilogues.py``).
      gemm_epilogue_backward: with ``gemm_epilogues``, the GELU gradient fed by the
        down-projection's grad-input ``mm`` in its epilogue too.
      batch_casts: the casts of the step's inputs to a 16-bit dtype in one multi-tensor launch
        (``passes/batch_casts.py``).
      column_sums: Inductor's mix-order reductions' final sums as fsg's column-sum kernel
        (stage 4, ``backend/column_sums.py``; the slices they write are corrected either way).
      fp8_producers: under rowwise FP8, the producers (names in ``FP8_PRODUCERS``) whose kernel
        computes the cast of their output (``passes/float8/fuse.py``); empty: none.
      fp8_layer_norms: under rowwise FP8, a layer norm and the cast of its output in one kernel.
      fp8_residual_adds: with ``fp8_layer_norms``, the residual add the norm normalizes too.
      fp8_column_sums: under rowwise FP8, an operand's cast and its bias gradient's column sums
        in one read.
      fp8_weights: under rowwise FP8, a weight's two casts (of ``W`` and ``W.T``) in one op
        reading its float32 master.
      on_cpu: the CUDA-only passes (names in ``CUDA_PASSES``) that rewrite CPU graphs too, where
        their ops run the aten ops they replace: how CPU tests check those rewrites.

    >>> Fusions(batch_casts=False).tag()
    'fsg.fusions(batch_casts=False)'
    """

    pack_attention_grads: bool = True
    gemm_epilogues: bool = True
    gemm_epilogue_backward: bool = True
    batch_casts: bool = True
    column_sums: bool = True
    fp8_producers: frozenset[str] = FP8_PRODUCERS
    fp8_layer_norms: bool = True
    fp8_residual_adds: bool = True
    fp8_column_sums: bool = True
    fp8_weights: bool = True
    on_cpu: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.default in (True, False) and not isinstance(value, bool):
                raise ArgumentError(f"Fusions({field.name}=...) must be True or False, got {value!r}")
        for name, known in (("fp8_producers", FP8_PRODUCERS), ("on_cpu", CUDA_PASSES)):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ArgumentError(f"Fusions({name}=...) must be a set of names from {sorted(known)}, got {value!r}")
            if unknown := sorted(set(value) - known):
                raise ArgumentError(f"Fusions({name}=...): unknown {unknown}; the names are {sorted(known)}")
            object.__setattr__(self, name, frozenset(value))

    def on(self, name: str, device_type: str) -> bool:
        """Whether the CUDA-only pass ``name`` rewrites a tensor on ``device_type``."""
        return device_type == "cuda" or name in self.on_cpu

    def tag(self) -> str:
        """The fields that differ from the defaults, as a stable string (Inductor's cache tag)."""
        changed = [
            f"{f.name}={sorted(v) if isinstance(v, frozenset) else v}"
            for f in dataclasses.fields(self)
            if (v := getattr(self, f.name)) != f.default
        ]
        return f"fsg.fusions({', '.join(changed)})"


def check(fusions: object, where: str = "compile_step(fusions=...)") -> Fusions:
    """``fusions`` itself when it is a ``Fusions`` (``Fusions()`` for ``None``); raises
    ``ArgumentError`` otherwise."""
    if fusions is None:
        return Fusions()
    if not isinstance(fusions, Fusions):
        raise ArgumentError(
            f"{where} must be a Fusions (fsg._src.passes.options.Fusions), got {type(fusions).__name__}: "
            "build one with keyword arguments, e.g. Fusions(batch_casts=False)"
        )
    return fusions


DEFAULT = Fusions()
"""The fusions a step runs unless ``compile_step(fusions=...)`` says otherwise."""
