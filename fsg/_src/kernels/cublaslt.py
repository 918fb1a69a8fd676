"""cuBLASLt's matmul with a fused epilogue, called through ctypes: what torch does not expose.

torch's matmuls reach cuBLASLt's bias epilogue (``addmm``) and, through ``_addmm_activation``,
its GELU epilogue without the pre-activation a backward needs; not the training epilogues
``GELU_AUX_BIAS`` (the forward writes ``gelu(x @ w + b)`` and the pre-activation, one GEMM) and
``DGELU_BGRAD`` (the backward's GEMM writes ``(g @ w) * gelu'(pre)`` and its column sums, the
bias gradient). ``matmul`` calls them on torch's tensors and current stream, so a CUDA graph
captures them like any other kernel.

Only cuBLASLt's public C API is used (the header's enum values are spelled out below). The
library is the one torch loaded (``libcublasLt.so.*`` in the process); where it cannot be
found or a call fails, ``available`` is False or ``CublasLtError`` says which call and its
status, and the callers (``kernels/linear_gelu.py``) run the plain aten ops instead.

Row-major to cuBLASLt's column-major: ``out[M, N] = a[M, K] @ b[K, N]`` is the column-major
``D (N x M) = op(b) (N x K) @ op(a) (K x M)``; a bias or bias gradient runs along ``N``.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

# cublasLtEpilogue_t
EPILOGUE_GELU_AUX, EPILOGUE_GELU_AUX_BIAS = 32 | 128, 32 | 128 | 4
EPILOGUE_DGELU, EPILOGUE_DGELU_BGRAD = 64 | 128, 64 | 128 | 16
# cublasLtMatmulDescAttributes_t
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _AUX_POINTER, _AUX_LD = 3, 4, 7, 8, 11, 12
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE, _PREF_ALIGN_A, _PREF_ALIGN_B, _PREF_ALIGN_C, _PREF_ALIGN_D = 1, 5, 6, 7, 8
_COMPUTE_32F, _R_32F, _OP_N, _OP_T = 68, 0, 0, 1  # cublasComputeType_t, cudaDataType_t, cublasOperation_t
_DATA_TYPES = {torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
WORKSPACE_BYTES = 32 * 2**20  # torch's own cuBLASLt workspace on Hopper


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than success."""


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


def _library_path() -> str | None:
    """The ``libcublasLt`` torch loaded into this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcublasLt.so" in line}
    except OSError:
        return None
    return min(paths) if paths else None


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    path = _library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    vp, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                           ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_size_t, vp],
    }  # fmt: skip
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def available(device: torch.device) -> bool:
    """Whether ``matmul`` can run on ``device``: CUDA with torch's cuBLASLt loadable."""
    if device.type != "cuda":
        return False
    try:
        return _lib() is not None
    except (OSError, AttributeError):  # no such library, or one without these entry points
        return False


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"fsg: cuBLASLt's {call} returned status {status}")


_LOCK = threading.Lock()
_HANDLES: dict[int, int] = {}
_WORKSPACES: dict[int, torch.Tensor] = {}
_LAYOUTS: dict[tuple, int] = {}
_ALGOS: dict[tuple, list[_HeuristicResult]] = {}
CANDIDATES = 8  # heuristic results asked for (``matmul``'s ``algo`` picks one; 0, the first, by default)
# The heuristic's first candidate, not the fastest by timing: a choice by timing can differ
# between processes, and with it the rounding, which would break bit-exact resumes;
# benchmarks/gemm_epilogue.py --algos times every candidate in the heuristic's order.


def _handle(device: torch.device) -> tuple[int, torch.Tensor]:
    """The process's cuBLASLt handle and workspace for ``device`` (made once, kept)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        if index not in _HANDLES:  # matmul made index the current device
            handle = ctypes.c_void_p()
            _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            _HANDLES[index] = handle.value
            _WORKSPACES[index] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
    return _HANDLES[index], _WORKSPACES[index]


def _layout(dtype: int, rows: int, cols: int, ld: int) -> int:
    key = (dtype, rows, cols, ld)
    if key not in _LAYOUTS:  # kept for the process: a handful of shapes a model
        desc = ctypes.c_void_p()
        _check(
            _lib().cublasLtMatrixLayoutCreate(ctypes.byref(desc), dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate"
        )
        _LAYOUTS[key] = desc.value
    return _LAYOUTS[key]


def _operand(t: torch.Tensor) -> tuple[int, int] | None:
    """``(op, ld)`` of a row-major 2-D operand seen column-major: its transposition and leading
    dim; ``None`` for a layout cuBLASLt cannot read as it lies."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(1, cols):
        return _OP_N, t.stride(0)  # row-major [R, C] is column-major C x R: the transpose, read as is
    if t.stride(0) == 1 and t.stride(1) >= max(1, rows):
        return _OP_T, t.stride(1)
    return None


def _alignment(t: torch.Tensor | None) -> int:
    if t is None:
        return 256
    ptr = t.data_ptr()
    return min(256, ptr & -ptr) if ptr else 256


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``matmul(a, b, ...)`` takes these operands as they lie: 2-D, one 16-bit dtype,
    each row- or column-major, 16-byte aligned with dims in multiples of 8 (cuBLASLt's
    epilogues' conditions)."""
    return (
        a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype and a.dtype in _DATA_TYPES
        and a.shape[1] == b.shape[0] and all(d % 8 == 0 and d > 0 for d in (*a.shape, b.shape[1]))
        and _operand(a) is not None and _operand(b) is not None
        and _alignment(a) >= 16 and _alignment(b) >= 16
    )  # fmt: skip


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    epilogue: int,
    *,
    bias: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    algo: int = 0,
) -> torch.Tensor:
    """``out[M, N]`` (row-major, ``a``'s dtype) of ``a[M, K] @ b[K, N]`` through ``epilogue``:
    ``EPILOGUE_GELU_AUX_BIAS`` writes ``gelu_tanh(a @ b + bias)`` and the pre-activation into
    ``aux`` (``[M, N]``, contiguous), ``EPILOGUE_GELU_AUX`` the same without a bias;
    ``EPILOGUE_DGELU`` writes ``(a @ b) * gelu_tanh'(aux)``, ``EPILOGUE_DGELU_BGRAD`` that and
    its column sums into ``bias`` (``[N]``, ``a``'s dtype). The operands must pass
    ``supports``. One workspace a device: calls on one stream at a time (a step's). ``algo`` picks among cuBLASLt's heuristic candidates
    (0: its first choice; ``benchmarks/gemm_epilogue.py --algos`` times the others)."""
    with torch.cuda.device(a.device):  # the handle, stream and launch on a's device
        return _matmul(a, b, epilogue, bias, aux, algo)


def _matmul(a, b, epilogue: int, bias, aux, algo: int) -> torch.Tensor:
    lib, (M, K), N = _lib(), a.shape, b.shape[1]
    handle, workspace = _handle(a.device)
    dtype = _DATA_TYPES[a.dtype]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    (op_b, ld_b), (op_a, ld_a) = _operand(b), _operand(a)
    # column-major: D (N x M) = op(b) (N x K) @ op(a) (K x M)
    layout_b = _layout(dtype, *((N, K) if op_b == _OP_N else (K, N)), ld_b)
    layout_a = _layout(dtype, *((K, M) if op_a == _OP_N else (M, K)), ld_a)
    layout_d = _layout(dtype, N, M, N)
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
    try:
        attrs = [
            (_TRANSA, ctypes.c_int32(op_b)),
            (_TRANSB, ctypes.c_int32(op_a)),
            (_EPILOGUE, ctypes.c_uint32(epilogue)),
        ]
        if bias is not None:
            attrs.append((_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr())))
        if aux is not None:
            attrs += [(_AUX_POINTER, ctypes.c_void_p(aux.data_ptr())), (_AUX_LD, ctypes.c_int64(aux.stride(0)))]
        for attr, value in attrs:
            status = lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value))
            _check(status, f"cublasLtMatmulDescSetAttribute({attr})")
        key = (
            dtype,
            M,
            N,
            K,
            op_a,
            op_b,
            epilogue,
            _alignment(b),
            _alignment(a),
            _alignment(out),
            _alignment(bias),
            _alignment(aux),
        )
        candidates = _algos(handle, desc, (layout_b, layout_a, layout_d), key)
        if algo >= len(candidates):
            raise CublasLtError(f"fsg: cuBLASLt offers {len(candidates)} algorithms here, not {algo + 1}")
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = torch.cuda.current_stream(a.device)

        def run(choice: int) -> int:
            return lib.cublasLtMatmul(
                handle, desc, ctypes.byref(alpha), b.data_ptr(), layout_b, a.data_ptr(), layout_a, ctypes.byref(beta),
                out.data_ptr(), layout_d, out.data_ptr(), layout_d, ctypes.byref(candidates[choice].algo),
                workspace.data_ptr(), WORKSPACE_BYTES, stream.cuda_stream,
            )  # fmt: skip

        _check(run(algo), "cublasLtMatmul")
    finally:
        lib.cublasLtMatmulDescDestroy(desc)
    return out


def _algos(handle: int, desc, layouts: tuple, key: tuple) -> list[_HeuristicResult]:
    """cuBLASLt's heuristic choices for this problem, its best first (cached by shapes and
    alignments: ``key``, whose last five entries are the operands' alignments)."""
    alignments = key[-5:]
    if key in _ALGOS:
        return _ALGOS[key]
    lib, pref = _lib(), ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    size = ctypes.c_uint64(WORKSPACE_BYTES)
    lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(size), 8)
    for attr, align in zip((_PREF_ALIGN_A, _PREF_ALIGN_B, _PREF_ALIGN_D), alignments[:3]):
        value = ctypes.c_uint32(align)
        lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), 4)
    value = ctypes.c_uint32(alignments[2])
    lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_ALIGN_C, ctypes.byref(value), 4)
    results, count = (_HeuristicResult * CANDIDATES)(), ctypes.c_int(0)
    b, a, d = layouts
    status = lib.cublasLtMatmulAlgoGetHeuristic(
        handle, desc, b, a, d, d, pref, CANDIDATES, results, ctypes.byref(count)
    )
    lib.cublasLtMatmulPreferenceDestroy(pref)
    _check(status, "cublasLtMatmulAlgoGetHeuristic")
    if count.value == 0:
        raise CublasLtError(f"fsg: cuBLASLt has no algorithm for {key[:7]} (epilogue {key[6]})")
    _ALGOS[key] = [results[i] for i in range(count.value) if results[i].state == 0]
    return _ALGOS[key]
