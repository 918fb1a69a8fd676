"""An MLP's GELU inside its matmuls: the registered ops the ``gemm_epilogues`` pass
(``passes/gemm_epilogues.py``) puts in a 16-bit step.

Shape legend: M rows (tokens), K the matmul's contracted width, N its output width.

Left to Inductor, a GPT MLP's up-projection writes its pre-activation ``h``, a pointwise
kernel reads it back to write ``gelu(h)``; in the backward the down-projection's grad-input
GEMM writes ``da`` and a kernel reads ``da`` and ``h`` to write ``dh = da * gelu'(h)``.
cuBLASLt's training epilogues (``kernels/cublaslt.py``) do both inside the GEMMs:

- ``linear_gelu(x, w_t, bias) -> (y, h)``: ``h = x @ w_t + bias`` (``bias`` may be ``None``),
  ``y = gelu_tanh(h)``, one GEMM writing both (``GELU_AUX_BIAS``, or ``GELU_AUX``).
- ``mm_gelu_backward(g, w, h) -> dh``: ``dh = gelu_tanh'(h) * (g @ w)``, one GEMM (``DGELU``).
  The bias gradient ``dh.sum(0)`` stays Inductor's: cuBLASLt's ``DGELU_BGRAD``, which would
  sum it in the epilogue too, runs as the GEMM plus a generic epilogue kernel on the H200,
  twice the time of the unfused ops (benchmarks/gemm_epilogue.py, RESULTS.md 2026-12-04).

cuBLASLt's GELU is the tanh approximation, so only ``gelu(approximate="tanh")`` is fused.
Rounding differs from the unfused ops by where it happens: the epilogue applies the GELU (or
its gradient) to the float32 accumulator before rounding to bf16, where the unfused graph
rounds ``h`` (or ``da``) to bf16 first (``tests/gpu/test_kernels_cuda.py`` bounds the
difference). Off CUDA, or for operands cuBLASLt cannot take as they lie (``cublaslt.supports``),
each op runs the aten ops it replaces, bit for bit the unfused graph.
"""

from __future__ import annotations

import torch

from fsg._src.kernels import cublaslt

aten = torch.ops.aten


def fusable(x: torch.Tensor, w: torch.Tensor, *vectors: torch.Tensor) -> bool:
    """Whether cuBLASLt runs ``x @ w`` with an epilogue reading or writing ``vectors`` (the bias,
    the saved pre-activation): on a CUDA device where it loads, operands it takes as they lie,
    the vectors contiguous, 16-byte aligned and of the operands' dtype."""
    return (
        x.is_cuda and cublaslt.available(x.device) and cublaslt.supports(x, w)
        and all(v is None or (v.is_contiguous() and v.dtype == x.dtype and v.data_ptr() % 16 == 0) for v in vectors)
    )  # fmt: skip


@torch.library.custom_op("fsg::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)``: ``h = addmm(bias, x, w_t)`` (``mm(x, w_t)`` without a bias; ``[M, N]``) and
    ``y = gelu(h, approximate="tanh")``."""
    if fusable(x, w_t, bias):
        h = torch.empty((x.shape[0], w_t.shape[1]), dtype=x.dtype, device=x.device)
        epilogue = cublaslt.EPILOGUE_GELU_AUX if bias is None else cublaslt.EPILOGUE_GELU_AUX_BIAS
        return cublaslt.matmul(x, w_t, epilogue, bias=bias, aux=h), h
    h = aten.mm.default(x, w_t) if bias is None else aten.addmm.default(bias, x, w_t)
    return aten.gelu.default(h, approximate="tanh"), h


@torch.library.custom_op("fsg::mm_gelu_backward", mutates_args=())
def mm_gelu_backward(g: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``dh = gelu_backward(g @ w, h, approximate="tanh")`` (``[M, K]``; ``h`` of any shape
    with ``M * K`` elements)."""
    h_MK = h.reshape(g.shape[0], w.shape[1])
    if fusable(g, w, h_MK):
        return cublaslt.matmul(g, w, cublaslt.EPILOGUE_DGELU, aux=h_MK)
    return aten.gelu_backward.default(aten.mm.default(g, w), h_MK, approximate="tanh")


@linear_gelu.register_fake
def _(x, w_t, bias):
    return x.new_empty((x.shape[0], w_t.shape[1])), x.new_empty((x.shape[0], w_t.shape[1]))


@mm_gelu_backward.register_fake
def _(g, w, h):
    return g.new_empty((g.shape[0], w.shape[1]))
