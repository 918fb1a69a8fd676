"""An MLP's GELU, GELU gradient and bias gradient in cuBLASLt's GEMM epilogues against the
same work as Inductor compiles it, at GPT-2 widths on one GPU: the measurement behind the
``gemm_epilogues`` pass (``kernels/linear_gelu.py``).

    python benchmarks/gemm_epilogue.py                 # 124M, 355M and 1.3B MLP shapes
    python benchmarks/gemm_epilogue.py --tokens 16384 --widths 768 --algos   # each candidate

Rows per width D (M tokens, the MLP 4D wide), medians of ``triton.testing.do_bench``:
- forward: ``h = addmm(b, x, w.T)`` then ``gelu(h, "tanh")`` (``torch.compile`` of both:
  cuBLAS and one pointwise kernel) against ``fsg::linear_gelu`` (one GEMM); the bare GEMM
  alone as the floor.
- backward: ``dh = gelu_backward(g @ w2, h)`` and ``dh.sum(0)`` (``torch.compile``: cuBLAS and
  Inductor's fused pointwise + reduction) against ``fsg::mm_gelu_backward`` (``DGELU``) and the
  sum compiled by Inductor; the bare GEMM. ``bwd-bgrad``: the same against ``DGELU_BGRAD``, the
  bias gradient summed in the epilogue too (measured slower: not used).
Each fused result is checked against the compiled one (relative L2 error < 1e-2) first.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fsg._src.kernels import cublaslt
from fsg._src.kernels import linear_gelu as L


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--widths", default="768,1024,2048")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--algos", action="store_true", help="also time each of cuBLASLt's heuristic candidates")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16, M, rows = torch.bfloat16, args.tokens, []

    @torch.compile
    def forward(x, w, b):
        h = torch.addmm(b, x, w.t())
        return F.gelu(h, approximate="tanh"), h

    @torch.compile
    def backward(g, w2, h):
        dh = torch.ops.aten.gelu_backward.default(g @ w2, h, approximate="tanh")
        return dh, dh.sum(0)

    @torch.compile
    def backward_fused(g, w2, h):  # the op, and the bias gradient's sum as Inductor compiles it
        dh = L.mm_gelu_backward(g, w2, h)
        return dh, dh.sum(0)

    def dgelu_bgrad(g, w2, h):
        dbias = torch.empty(w2.shape[1], dtype=g.dtype, device=g.device)
        return cublaslt.matmul(g, w2, cublaslt.EPILOGUE_DGELU_BGRAD, bias=dbias, aux=h), dbias

    print(f"{'D':>6} {'case':<9} {'compiled (ms)':>14} {'fused (ms)':>11} {'bare GEMM (ms)':>15} {'saved':>7}")
    for D in map(int, args.widths.split(",")):
        N = 4 * D
        x, w, b = torch.randn(M, D, dtype=bf16, device="cuda"), torch.randn(N, D, dtype=bf16, device="cuda") / D**0.5, torch.randn(N, dtype=bf16, device="cuda")
        g, w2 = torch.randn(M, D, dtype=bf16, device="cuda"), torch.randn(D, N, dtype=bf16, device="cuda") / N**0.5
        h = forward(x, w, b)[1]
        (y_ref, h_ref), (y, h_fused) = forward(x, w, b), L.linear_gelu(x, w.t(), b)
        (dh_ref, db_ref), (dh, db) = backward(g, w2, h), backward_fused(g, w2, h)
        errors = [rel(y, y_ref), rel(h_fused, h_ref), rel(dh, dh_ref), rel(db, db_ref.float())]
        assert max(errors) < 1e-2, errors
        cases = {
            "forward": (lambda: forward(x, w, b), lambda: L.linear_gelu(x, w.t(), b), lambda: x @ w.t()),
            "backward": (lambda: backward(g, w2, h), lambda: backward_fused(g, w2, h), lambda: g @ w2),
            # the bias gradient in the epilogue too (DGELU_BGRAD): measured slower, not used
            "bwd-bgrad": (lambda: backward(g, w2, h), lambda: dgelu_bgrad(g, w2, h), lambda: g @ w2),
        }
        for case, fns in cases.items():
            compiled, fused, bare = (do_bench(fn, warmup=25, rep=200) for fn in fns)
            rows.append({"D": D, "M": M, "case": case, "compiled_ms": compiled, "fused_ms": fused, "gemm_ms": bare})
            print(f"{D:>6} {case:<9} {compiled:>14.3f} {fused:>11.3f} {bare:>15.3f} {compiled - fused:>7.3f}")
        if args.algos:
            epilogues = {"forward": (x, w.t(), cublaslt.EPILOGUE_GELU_AUX_BIAS, b, torch.empty_like(h)),
                         "backward": (g, w2, cublaslt.EPILOGUE_DGELU, None, h),
                         "bwd-bgrad": (g, w2, cublaslt.EPILOGUE_DGELU_BGRAD, torch.empty(N, dtype=bf16, device="cuda"), h)}  # fmt: skip
            for case, (a_, b_, epilogue, vec, aux) in epilogues.items():
                times = []
                for algo in range(cublaslt.CANDIDATES):
                    try:
                        times.append(do_bench(lambda: cublaslt.matmul(a_, b_, epilogue, bias=vec, aux=aux, algo=algo), warmup=10, rep=50))
                    except cublaslt.CublasLtError:
                        break
                rows.append({"D": D, "M": M, "case": case, "candidates_ms": times})
                print(f"{D:>6} {case:<9} cuBLASLt's candidates (ms): {' '.join(f'{t:.3f}' for t in times)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
