"""Blockwise-scaled FP8 GEMMs (DeepSeek-V3's 1x128 / 128x128 scales) against rowwise and bf16.

Why it was measured: under ``Float8(recipe="rowwise", grad_weight="fp8")`` the grad-weight's
operands are scaled along the tokens, so each needs a reduction over all rows before its
transposed cast. With 1x128 scales (one per 128 tokens of a column) every cast is local and
could run in its producer's kernel. That only pays if the blockwise GEMMs run near the
rowwise ones. This script times each of a linear layer's three GEMMs at GPT-2 355M and 1.3B
widths (M = 16,384 tokens) through ``torch._scaled_mm``:

- bf16 ``mm``;
- rowwise (a scale per row of A and per column of B), with and without fast accumulation;
- blockwise: the forward and grad-input as 1x128 (activation, gradient) x 128x128 (weight),
  the grad-weight as 1x128 x 1x128 (both along the tokens). cuBLAS refuses fast
  accumulation with blockwise scales, so those rows accumulate exactly.

Medians of ``triton.testing.do_bench`` (ms), and each blockwise result's relative error to the
bf16 product (the FP8 rounding, ~3.7%). Usage: ``python benchmarks/fp8_blockwise.py`` (CUDA,
FP8 tensor cores; RESULTS.md, H200, 2026-12-04).
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

E4M3, FP8_MAX, TOKENS = torch.float8_e4m3fn, 448.0, 16384
SHAPES = [("1.3B qkv", 2048, 6144), ("1.3B proj", 2048, 2048), ("1.3B fc1", 2048, 8192), ("1.3B fc2", 8192, 2048),
          ("355M qkv", 1024, 3072), ("355M proj", 1024, 1024), ("355M fc1", 1024, 4096), ("355M fc2", 4096, 1024)]  # fmt: skip


def outer_dim_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with stride(0) == 1: the layout cuBLAS takes 1x128 scales in."""
    return t.t().contiguous().t()


def rows(x: torch.Tensor):
    """A scale per row: e4m3 values and ``[R, 1]`` inverse scales."""
    scale = FP8_MAX / x.abs().amax(1, keepdim=True).float().clamp_min(1e-12)
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3), 1 / scale


def blocks_1x128(x: torch.Tensor):
    """A scale per 128 elements of a row: e4m3 values and ``[R, C / 128]`` inverse scales."""
    r, c = x.shape
    xb = x.float().view(r, c // 128, 128)
    scale = FP8_MAX / xb.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    q = (xb * scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(r, c)
    return q, outer_dim_major((1 / scale).view(r, c // 128))


def blocks_128x128(w: torch.Tensor):
    """A scale per 128 x 128 tile: e4m3 values and ``[N / 128, K / 128]`` inverse scales."""
    n, k = w.shape
    wb = w.float().view(n // 128, 128, k // 128, 128)
    scale = FP8_MAX / wb.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12)
    q = (wb * scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(n, k)
    return q, (1 / scale).view(n // 128, k // 128)


def scaled(a, b, sa, sb, fast):
    return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)


def main() -> None:
    bench = lambda f: do_bench(f, warmup=25, rep=100)  # noqa: E731
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}\n")
    print("| GEMM | matmul | bf16 | rowwise | rowwise, fast accum | blockwise | blockwise error |")
    print("|---|---|---|---|---|---|---|")
    for name, k, n in SHAPES:
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        (qx, sx), (qw, sw), (qdy, sdy) = rows(x), rows(w), rows(dy)
        (qwt, swt), (qdyt, sdyt), (qxt, sxt) = rows(w.t().contiguous()), rows(dy.t().contiguous()), rows(x.t().contiguous())
        (bx, bsx), (bw, bsw), (bdy, bsdy) = blocks_1x128(x), blocks_128x128(w), blocks_1x128(dy)
        (bdyt, bsdyt), (bxt, bsxt), bwt = blocks_1x128(dy.t().contiguous()), blocks_1x128(x.t().contiguous()), bw.t().contiguous()
        cases = {  # matmul: (bf16, rowwise(fast), blockwise, reference)
            "forward": (lambda: x @ w.t(), lambda f: scaled(qx, qw.t(), sx, sw.t(), f),
                        lambda: scaled(bx, bw.t(), bsx, bsw.t(), False), x @ w.t()),
            "grad-input": (lambda: dy @ w, lambda f: scaled(qdy, qwt.t(), sdy, swt.t(), f),
                           lambda: scaled(bdy, bwt.t(), bsdy, bsw, False), dy @ w),
            "grad-weight": (lambda: dy.t() @ x, lambda f: scaled(qdyt, qxt.t(), sdyt, sxt.t(), f),
                            lambda: scaled(bdyt, bxt.t(), bsdyt, bsxt.t(), False), dy.t() @ x),
        }  # fmt: skip
        for matmul, (plain, rowwise, blockwise, ref) in cases.items():
            error = float((blockwise().float() - ref.float()).norm() / ref.float().norm())
            times = [bench(plain), bench(lambda: rowwise(False)), bench(lambda: rowwise(True)), bench(blockwise)]
            print(f"| {name} | {matmul} | " + " | ".join(f"{t:.3f}" for t in times) + f" | {error:.4f} |", flush=True)


if __name__ == "__main__":
    main()
