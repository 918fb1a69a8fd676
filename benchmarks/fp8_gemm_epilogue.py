"""Rowwise-scaled FP8 GEMMs through cuBLASLt (``OUTER_VEC_32F`` scales) against ``torch._scaled_mm``,
and the MLP's GELU epilogues on them: can the FP8 step fold the GELU gradient into the
grad-input GEMM as the bf16 step does (``kernels/linear_gelu.py``)?

    python benchmarks/fp8_gemm_epilogue.py                  # 355M and 1.3B widths
    python benchmarks/fp8_gemm_epilogue.py --widths 1024 --json out.json

Per width D (M tokens; medians of ``triton.testing.do_bench``, ms):
- ``gemm``: each layer GEMM shape (``[M, K] @ [K, N]``, both operands FP8 with a scale per row
  of the first and per column of the second, fast accumulation) by ``torch._scaled_mm`` and by
  cuBLASLt's outer-vector scaling, with the relative error between the two.
- ``dgelu``: the MLP's second grad-input and the GELU gradient with its FP8 cast and column
  sums: ``_scaled_mm`` then ``fsg::gelu_backward_fp8`` (fsg's step today) against cuBLASLt's
  ``DGELU`` epilogue then ``fsg::rowwise_fp8`` (one pass over the bf16 result fewer).
- ``gelu``: the first MLP matmul: ``_scaled_mm`` then ``fsg::gelu_fp8`` against cuBLASLt's
  ``GELU_AUX`` epilogue (the pre-activation in the aux buffer) then ``fsg::rowwise_fp8``.
A row says ``unsupported`` where cuBLASLt offers no algorithm (its status).
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
from triton.testing import do_bench

import fsg  # noqa: F401  (registers the fsg:: ops)
from fsg._src.kernels import cublaslt as lt

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
_R_8F_E4M3, _R_16BF = 28, 14  # cudaDataType_t
_A_SCALE, _B_SCALE, _AUX_TYPE, _FAST_ACCUM, _A_SCALE_MODE, _B_SCALE_MODE = 17, 18, 22, 25, 31, 32
OUTER_VEC_32F, SCALAR_32F, EPILOGUE_DEFAULT = 3, 0, 1


def fp8_matmul(a, bt, inv_a, inv_b, epilogue=EPILOGUE_DEFAULT, aux=None, scale_mode=OUTER_VEC_32F, fast=True):
    """``out[M, N] = (a * inv_a) @ (bt * inv_b.T).T`` in bf16 (``a [M, K]``, ``bt [N, K]``
    row-major E4M3; ``inv_a`` ``[M]``, ``inv_b`` ``[N]`` float32, or scalars with
    ``SCALAR_32F``), through ``epilogue`` with ``aux`` (``[M, N]`` bf16) as in ``lt.matmul``."""
    lib, (M, K), N = lt._lib(), a.shape, bt.shape[0]
    handle, workspace = lt._handle(a.device)
    out = torch.empty((M, N), dtype=BF16, device=a.device)
    # column-major: D (N x M) = op(bt as K x N, ld K)=T (N x K) @ (a as K x M, ld K) (K x M)
    layout_b, layout_a, layout_d = (
        lt._layout(_R_8F_E4M3, K, N, K),
        lt._layout(_R_8F_E4M3, K, M, K),
        lt._layout(_R_16BF, N, M, N),
    )
    desc = ctypes.c_void_p()
    lt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), lt._COMPUTE_32F, lt._R_32F), "cublasLtMatmulDescCreate")
    try:
        attrs = [
            (lt._TRANSA, ctypes.c_int32(lt._OP_T)), (lt._TRANSB, ctypes.c_int32(lt._OP_N)),
            (lt._EPILOGUE, ctypes.c_uint32(epilogue)), (_FAST_ACCUM, ctypes.c_int8(int(fast))),
            (_A_SCALE, ctypes.c_void_p(inv_b.data_ptr())), (_B_SCALE, ctypes.c_void_p(inv_a.data_ptr())),
            (_A_SCALE_MODE, ctypes.c_int32(scale_mode)), (_B_SCALE_MODE, ctypes.c_int32(scale_mode)),
        ]  # fmt: skip
        if aux is not None:
            attrs += [(lt._AUX_POINTER, ctypes.c_void_p(aux.data_ptr())), (lt._AUX_LD, ctypes.c_int64(aux.stride(0))),
                      (_AUX_TYPE, ctypes.c_int32(_R_16BF))]  # fmt: skip
        for attr, value in attrs:
            lt._check(
                lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                f"SetAttribute({attr})",
            )
        key = ("fp8", scale_mode, M, N, K, epilogue, *(lt._alignment(t) for t in (bt, a, out, None, aux)))
        algo = lt._algos(handle, desc, (layout_b, layout_a, layout_d), key)[0]
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = torch.cuda.current_stream(a.device)
        status = lib.cublasLtMatmul(
            handle, desc, ctypes.byref(alpha), bt.data_ptr(), layout_b, a.data_ptr(), layout_a, ctypes.byref(beta),
            out.data_ptr(), layout_d, out.data_ptr(), layout_d, ctypes.byref(algo.algo), workspace.data_ptr(),
            lt.WORKSPACE_BYTES, stream.cuda_stream,
        )  # fmt: skip
        lt._check(status, "cublasLtMatmul")
    finally:
        lib.cublasLtMatmulDescDestroy(desc)
    return out


def rowwise(x):
    """``x``'s rowwise E4M3 copy and inverse scales ``[M]`` (float32)."""
    q, inv, _, _ = torch.ops.fsg.rowwise_fp8(x)
    return q, inv.reshape(-1)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def attempt(fn):
    try:
        return fn(), None
    except lt.CublasLtError as e:
        return None, str(e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--widths", default="1024,2048")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    M, rows = args.tokens, []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for D in map(int, args.widths.split(",")):
        shapes = {"qkv": (D, 3 * D), "proj": (D, D), "fc1": (D, 4 * D), "fc2": (4 * D, D),
                  "qkv-gi": (3 * D, D), "fc1-gi": (4 * D, D), "fc2-gi": (D, 4 * D)}  # fmt: skip
        for name, (K, N) in shapes.items():
            a, inv_a = rowwise(torch.randn(M, K, device="cuda", dtype=BF16))
            bt, inv_b = rowwise(torch.randn(N, K, device="cuda", dtype=BF16) * 0.02)
            ref = torch._scaled_mm(a, bt.t(), inv_a[:, None], inv_b[None, :], out_dtype=BF16, use_fast_accum=True)
            out, err = attempt(lambda: fp8_matmul(a, bt, inv_a, inv_b))
            row = {"width": D, "case": "gemm", "shape": name, "M": M, "K": K, "N": N,
                   "scaled_mm": do_bench(lambda: torch._scaled_mm(a, bt.t(), inv_a[:, None], inv_b[None, :], out_dtype=BF16, use_fast_accum=True))}  # fmt: skip
            if err is None:
                row.update(cublaslt=do_bench(lambda: fp8_matmul(a, bt, inv_a, inv_b)), rel_err=rel(out, ref))
            else:
                row["unsupported"] = err
            emit(row)
        # the MLP's GELU gradient: dg = dy @ w2 (fc2's grad-input), dh = gelu'(h) * dg, its FP8 copy and column sums
        K, N = D, 4 * D
        dy, inv_dy = rowwise(torch.randn(M, K, device="cuda", dtype=BF16))
        w2t, inv_w2 = rowwise(torch.randn(N, K, device="cuda", dtype=BF16) * 0.02)
        h = torch.randn(M, N, device="cuda", dtype=BF16)

        def today_bwd():
            dg = torch._scaled_mm(dy, w2t.t(), inv_dy[:, None], inv_w2[None, :], out_dtype=BF16, use_fast_accum=True)
            return torch.ops.fsg.gelu_backward_fp8(dg, h, "tanh")

        def epilogue_bwd(scale_mode=OUTER_VEC_32F):
            dh = fp8_matmul(dy, w2t, inv_dy, inv_w2, lt.EPILOGUE_DGELU, aux=h, scale_mode=scale_mode)
            return (dh, *torch.ops.fsg.rowwise_fp8(dh))

        ref = today_bwd()
        out, err = attempt(epilogue_bwd)
        row = {"width": D, "case": "dgelu", "M": M, "K": K, "N": N, "today": do_bench(today_bwd)}
        if err is None:
            row.update(epilogue=do_bench(epilogue_bwd), rel_err=rel(out[0], ref[0]), colsum_rel_err=rel(out[3], ref[3]))
        else:
            row["unsupported"] = err
            inv_s = torch.ones((), device="cuda")
            _, err_scalar = attempt(
                lambda: fp8_matmul(dy, w2t, inv_s, inv_s, lt.EPILOGUE_DGELU, aux=h, scale_mode=SCALAR_32F)
            )
            row["scalar_scales"] = err_scalar or "supported"
        emit(row)
        # the MLP's first matmul: h = x @ w1.T, g = gelu(h) and g's FP8 copy
        x, inv_x = rowwise(torch.randn(M, K, device="cuda", dtype=BF16))
        w1, inv_w1 = rowwise(torch.randn(N, K, device="cuda", dtype=BF16) * 0.02)

        def today_fwd():
            hh = torch._scaled_mm(x, w1.t(), inv_x[:, None], inv_w1[None, :], out_dtype=BF16, use_fast_accum=True)
            return (hh, *torch.ops.fsg.gelu_fp8(hh, "tanh"))

        def epilogue_fwd():
            hh = torch.empty(M, N, device="cuda", dtype=BF16)
            g = fp8_matmul(x, w1, inv_x, inv_w1, lt.EPILOGUE_GELU_AUX, aux=hh)
            return (hh, g, *torch.ops.fsg.rowwise_fp8(g))

        ref = today_fwd()
        out, err = attempt(epilogue_fwd)
        row = {"width": D, "case": "gelu", "M": M, "K": K, "N": N, "today": do_bench(today_fwd)}
        if err is None:
            row.update(epilogue=do_bench(epilogue_fwd), rel_err=rel(out[1], ref[1]), aux_rel_err=rel(out[0], ref[0]))
        else:
            row["unsupported"] = err
        emit(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
