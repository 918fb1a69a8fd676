"""Attention's backward writing the fused qkv projection's gradient in place: the registered op
the ``pack_attention_grads`` pass (``passes/pack_attention_grads.py``) puts in a 16-bit step.

Shape legend: B batch, H heads, T tokens, D head width, C = H * D.

A GPT's attention reads ``q, k, v`` as views of one projection ``qkv [B, T, 3C]`` (split, then
heads transposed). Its backward, torch's cuDNN kernel, writes ``dq, dk, dv`` into three
buffers of their own, and the graph concatenates them, ``cat([dq, dk, dv], -1)``, into the
``[B, T, 3C]`` gradient that the projection's matmuls read: a copy of every byte of the
gradient (GPT-2 124M on an H200: 35 us a layer, 0.42 ms a step). cuDNN's backward takes any
strides for its outputs, so ``attention_backward_packed`` hands it three views of one
``[B, T, 3, H, D]`` buffer and returns that buffer as ``[B, T, 3C]``: the concatenation,
without the copy. cuDNN is reached through NVIDIA's ``cudnn`` Python package
(``pip install nvidia-cudnn-frontend``, or the ``fsg[cudnn]`` extra), which binds the cuDNN
library torch already loaded; each problem (shapes, strides, dtype, mask, scale) builds its
cuDNN graph once, on its first call outside a CUDA-graph capture (fsg's warm-up run); a
problem first met inside a capture runs the aten backward there, and in that graph's replays.

The values are cuDNN's, computed by the same kernels as torch's backward: equal to it up to the
order of dq's float32 atomic sums, which already differs from run to run in torch's own
(``tests/gpu/test_attention_grads_cuda.py``). Without the package, on CPU (the tests force the
rewrite there), or for inputs the cuDNN graph does not take, the op runs the aten backward it
replaces and the concatenation, bit for bit the graph it replaced.
"""

from __future__ import annotations

import atexit
import logging
import threading

import torch

aten = torch.ops.aten
log = logging.getLogger("fsg")
_DTYPES = (torch.bfloat16, torch.float16)
_LOCK = threading.Lock()
_STATE: dict = {}  # "module": the cudnn package or None; per device: handle; per problem: graph
_MIN_VERSION = (1, 14)
# the cuDNN graphs and handles go before the interpreter does (nanobind, which binds the newer
# packages, reports objects still alive at exit as leaks)
atexit.register(_STATE.clear)


def _cudnn():
    """NVIDIA's ``cudnn`` package, imported once after torch has loaded its cuDNN library, or
    ``None`` (with one INFO line saying why) where it is missing or too old."""
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"] = None
            try:
                torch.backends.cudnn.version()  # torch loads libcudnn first: the package binds that one
                import cudnn

                version = tuple(int(p) for p in cudnn.__version__.split(".")[:2])
                if version < _MIN_VERSION:
                    raise ImportError(f"nvidia-cudnn-frontend {cudnn.__version__} is older than 1.14")
                _STATE["module"] = cudnn
            except Exception as exc:  # noqa: BLE001 - any failure to load means: no packed gradients
                log.info(
                    "fsg: attention's qkv gradient stays three buffers and a concatenation (%s); "
                    "pip install nvidia-cudnn-frontend (the fsg[cudnn] extra) writes it in place",
                    exc,
                )
        return _STATE["module"]


def available(device: torch.device) -> bool:
    """Whether ``attention_backward_packed`` runs cuDNN's packed backward on ``device``: CUDA,
    cuDNN enabled in torch, and NVIDIA's ``cudnn`` package importable."""
    return device.type == "cuda" and torch.backends.cudnn.is_available() and _cudnn() is not None


@torch.library.custom_op("fsg::attention_backward_packed", mutates_args=())
def attention_backward_packed(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    philox_seed: torch.Tensor | None,
    philox_offset: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """``cat([dq, dk, dv], -1)`` as ``[B, T, 3C]`` (each ``d*`` transposed to ``[B, T, H, D]``
    and flattened), the gradients of attention without dropout or mask other than causal;
    ``q, k, v, out, grad_out`` are ``[B, H, T, D]``, ``logsumexp`` the forward's."""
    B, H, T, D = q.shape
    packed = torch.empty((B, T, 3, H, D), dtype=q.dtype, device=q.device)
    grads = [packed.select(2, i).transpose(1, 2) for i in range(3)]  # [B, H, T, D] views
    if not (q.is_cuda and _packed_backward(grad_out, q, k, v, out, logsumexp, grads, is_causal, scale)):
        for dst, src in zip(
            grads, _reference(grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, is_causal, scale)
        ):
            dst.copy_(src)
    return packed.view(B, T, 3 * H * D)


@attention_backward_packed.register_fake
def _(grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, is_causal, scale):
    B, H, T, D = q.shape
    return q.new_empty((B, T, 3 * H * D))


def _reference(grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, is_causal, scale):
    """``dq, dk, dv`` from the aten backward the op replaces: torch's cuDNN kernel on CUDA, its
    CPU flash kernel on CPU."""
    if q.is_cuda:
        T, S = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_cudnn_attention_backward.default(
            grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, None, None, None, T, S, 0.0, is_causal,
            scale=scale,
        )  # fmt: skip
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, q, k, v, out, logsumexp, 0.0, is_causal, scale=scale
    )


def _packed_backward(grad_out, q, k, v, out, logsumexp, grads, is_causal, scale) -> bool:
    """Runs cuDNN's backward into ``grads`` (views of the packed buffer); False where it cannot
    (no package, a dtype or layout cuDNN's graph does not take), and nothing is written."""
    tensors = (q, k, v, out, grad_out)
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype or not _aligned(t) for t in tensors):
        return False
    if k.shape != q.shape or v.shape != q.shape or logsumexp.dtype != torch.float32 or not available(q.device):
        return False
    B, H, T, _ = q.shape
    stats = logsumexp if logsumexp.dim() == 4 else logsumexp.unsqueeze(-1)
    if stats.shape != (B, H, T, 1):
        return False
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    inputs = (*tensors, stats)
    key = (q.device.index, q.dtype, bool(is_causal), float(scale), *((t.shape, t.stride()) for t in (*inputs, *grads)))
    if key not in _STATE and torch.cuda.is_current_stream_capturing():
        return False  # no cuDNN graph is built inside a capture (that call, and its replays, take aten's)
    built = _graph(key, inputs, grads, is_causal, scale)
    if built is None:
        return False
    graph, uids = built
    cudnn, handle = _STATE["module"], _handle(q.device)
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    graph.execute(dict(zip(uids, (*inputs, *grads))), workspace, handle=handle)
    return True


def _aligned(t: torch.Tensor) -> bool:
    """Rows cuDNN reads in 16-byte vectors: a unit last stride, the other strides and the address
    multiples of 16 bytes (checked per call: a graph built for one problem is reused for every
    tensor of its shapes and strides, wherever it lies)."""
    unit = 16 // t.element_size()
    return t.stride(-1) == 1 and all(s % unit == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def _handle(device: torch.device):
    with _LOCK:
        key = ("handle", device.index)
        if key not in _STATE:
            with torch.cuda.device(device):
                _STATE[key] = _STATE["module"].create_handle()
        return _STATE[key]


def _graph(key: tuple, inputs: tuple, grads: list, is_causal: bool, scale: float):
    """The built cuDNN graph of one problem and its tensors (in ``inputs, grads`` order), or
    ``None`` where cuDNN does not support it (said once at INFO)."""
    if key not in _STATE:
        try:
            _STATE[key] = _build(inputs, grads, is_causal, scale)
        except Exception as exc:  # noqa: BLE001 - cuDNN's own errors: unsupported problem
            log.info("fsg: cuDNN's packed attention backward does not take %s (%s); the aten backward runs", key, exc)
            _STATE[key] = None
    return _STATE[key]


def _build(inputs: tuple, grads: list, is_causal: bool, scale: float):
    cudnn, handle = _STATE["module"], _handle(inputs[0].device)
    io = cudnn.data_type.BFLOAT16 if inputs[0].dtype == torch.bfloat16 else cudnn.data_type.HALF
    graph = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )  # fmt: skip
    q, k, v, o, do, stats = (graph.tensor_like(t) for t in inputs)
    dq, dk, dv = graph.sdpa_backward(q, k, v, o, do, stats, attn_scale=scale, use_causal_mask=bool(is_causal))
    for node, t in zip((dq, dk, dv), grads):
        node.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride())).set_data_type(io)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, (q, k, v, o, do, stats, dq, dk, dv)
