"""The weight-gradient GEMM with cuBLASLt's ``BGRADB`` epilogue (the bias gradient summed over
the GEMM's k dimension, the tokens) against ``torch.compile`` of ``dY.t() @ X`` and
``dY.sum(0)``, at GPT-2 widths on one GPU: the probe behind RESULTS.md's BGRADB
table (H200, 2026-12-04) (the epilogue costs what the separate sum costs, so fsg does not use it).

    python benchmarks/gemm_bgrad.py            # one JSON line per (width, GEMM)

Each line: the epilogue's time for each of cuBLASLt's heuristic candidates (``bgradb``, ms,
medians of ``triton.testing.do_bench``), the compiled pair, the bare mm and the sum alone, and
the epilogue's relative L2 errors against the compiled results.
"""

from __future__ import annotations

import json

import torch
from triton.testing import do_bench

from fsg._src.kernels import cublaslt

EPILOGUE_BGRADB = 512  # cublasLtEpilogue_t
M = 16384  # tokens: batch 16 x 1024


@torch.compile
def compiled(g, x):
    return g.t() @ x, g.sum(0)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> None:
    torch.manual_seed(0)
    for D in (768, 1024, 2048):
        for name, n_out, k_in in (("fc", 4 * D, D), ("qkv", 3 * D, D), ("proj_mlp", D, 4 * D), ("proj_attn", D, D)):
            g = torch.randn(M, n_out, dtype=torch.bfloat16, device="cuda")
            x = torch.randn(M, k_in, dtype=torch.bfloat16, device="cuda")
            dW_ref, db_ref = compiled(g, x)
            db = torch.empty(n_out, dtype=torch.bfloat16, device="cuda")
            dW = cublaslt.matmul(g.t(), x, EPILOGUE_BGRADB, bias=db)
            row = {"D": D, "case": name, "N": n_out, "K": k_in, "err_dW": rel(dW, dW_ref), "err_db": rel(db, db_ref)}
            keys = [k for k in cublaslt._ALGOS if k[6] == EPILOGUE_BGRADB and k[1] == n_out and k[2] == k_in]
            candidates = len(cublaslt._ALGOS[keys[0]]) if keys else 1
            row["bgradb"] = [round(do_bench(lambda a=a: cublaslt.matmul(g.t(), x, EPILOGUE_BGRADB, bias=db, algo=a)), 4)
                             for a in range(candidates)]  # fmt: skip
            row["compiled"] = round(do_bench(lambda: compiled(g, x)), 4)
            row["bare"] = round(do_bench(lambda: g.t() @ x), 4)
            row["sum_only"] = round(do_bench(lambda: g.sum(0)), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
