"""The small memset nodes of a captured step graph, rewritten as kernel nodes.

Libraries fsg calls zero small buffers before their kernels: cuBLAS's cooperative GEMMs a
4-byte counter before each (about 100 a step at GPT-2 124M), cuDNN's attention a few more.
Captured into a CUDA graph, each becomes a memset node, and on an H200 (driver 580, CUDA 13)
a memset node costs ~1.5 us of idle device before it and 2-3 us after it, against ~0.4 us
between two kernel nodes (chrome traces in benchmarks/RESULTS.md, eighteenth session): at 124M
about 0.7 ms of the step's 1.0 ms of gaps sat around its ~124 memsets.

``as_kernel_nodes(graph)`` walks the captured ``cudaGraph_t`` (``torch.cuda.CUDAGraph`` made
with ``keep_graph=True``, read through ``raw_cuda_graph()``: public, beta in torch 2.8+) and
replaces every top-level memset node of at most ``MAX_BYTES`` by a kernel node that writes the
same value to the same bytes (``_FILL_PTX``: one thread an element of 1, 2 or 4 bytes, pitched
rows as the memset has them), with the same predecessors and successors, so every kernel still
sees its buffer zeroed exactly where it did. A node whose edges carry data (a programmatic
launch edge, which a plain kernel could not honour) is left as it is. The graph is then
instantiated by the caller.

It uses the CUDA driver API (``libcuda``, through ctypes: ``cuGraph*`` calls present since
CUDA 12.3) and loads its kernel from PTX text, so it needs neither a compiler nor Triton.
Anything unexpected (a driver without the calls, a call that fails) leaves the graph as
captured, with one log line: the rewrite can only cost its speed-up, never a step.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("fsg")

ENABLED = True  # benchmarks/gpt.py's fsg-graphmemsets turns it off for the A/B
MAX_BYTES = 1 << 16  # larger memsets run long enough that their node's overhead matters less
_NODE_KERNEL, _NODE_MEMSET = 0, 2
_BLOCK = 128

# fill(dst, value, element_size, width, height, pitch): element i of the width x height
# region (rows ``pitch`` bytes apart) gets ``value``'s low ``element_size`` bytes.
_FILL_PTX = rb"""
.version 7.0
.target sm_52
.address_size 64

.visible .entry fsg_fill(
    .param .u64 p_dst, .param .u32 p_value, .param .u32 p_size,
    .param .u64 p_width, .param .u64 p_height, .param .u64 p_pitch)
{
    .reg .pred %p<5>;
    .reg .b16 %h<2>;
    .reg .b32 %r<7>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_dst];
    ld.param.u32 %r1, [p_value];
    ld.param.u32 %r2, [p_size];
    ld.param.u64 %rd2, [p_width];
    ld.param.u64 %rd3, [p_height];
    ld.param.u64 %rd4, [p_pitch];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mul.wide.u32 %rd5, %r3, %r4;
    cvt.u64.u32 %rd6, %r5;
    add.u64 %rd5, %rd5, %rd6;
    mul.lo.u64 %rd7, %rd2, %rd3;
    setp.ge.u64 %p1, %rd5, %rd7;
    @%p1 bra DONE;
    div.u64 %rd8, %rd5, %rd2;
    rem.u64 %rd9, %rd5, %rd2;
    mul.lo.u64 %rd10, %rd8, %rd4;
    cvt.u64.u32 %rd11, %r2;
    mul.lo.u64 %rd12, %rd9, %rd11;
    add.u64 %rd13, %rd1, %rd10;
    add.u64 %rd13, %rd13, %rd12;
    cvta.to.global.u64 %rd14, %rd13;
    cvt.u16.u32 %h1, %r1;
    setp.eq.u32 %p2, %r2, 4;
    @%p2 st.global.u32 [%rd14], %r1;
    setp.eq.u32 %p3, %r2, 2;
    @%p3 st.global.u16 [%rd14], %h1;
    setp.eq.u32 %p4, %r2, 1;
    @%p4 st.global.u8 [%rd14], %h1;
DONE:
    ret;
}
"""


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]  # fmt: skip


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]  # fmt: skip


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData: all zero for a plain dependency
    _fields_ = [("raw", ctypes.c_uint8 * 8)]


_driver = None
_functions: dict[int, ctypes.c_void_p] = {}  # device index -> the loaded fill kernel


def _cu():
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} returned CUDA driver error {result}")


def _fill_function() -> ctypes.c_void_p:
    device = torch.cuda.current_device()
    if device not in _functions:
        cu, module, func = _cu(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_FILL_PTX + b"\0")), "cuModuleLoadData")
        _check(cu.cuModuleGetFunction(ctypes.byref(func), module, b"fsg_fill"), "cuModuleGetFunction")
        _functions[device] = func
    return _functions[device]


def _edges(getter, node: ctypes.c_void_p) -> tuple[list[int], bool]:
    """The nodes on one side of ``node`` (``getter``: dependencies or dependents) and whether
    every edge is a plain one."""
    count = ctypes.c_size_t(0)
    _check(getter(node, None, None, ctypes.byref(count)), "cuGraphNodeGet*_v2")
    nodes, data = (ctypes.c_void_p * max(count.value, 1))(), (_EdgeData * max(count.value, 1))()
    _check(getter(node, nodes, data, ctypes.byref(count)), "cuGraphNodeGet*_v2")
    plain = all(not any(data[i].raw) for i in range(count.value))
    return [nodes[i] for i in range(count.value)], plain


def _graph_nodes(graph: int) -> list[ctypes.c_void_p]:
    cu, count = _cu(), ctypes.c_size_t(0)
    _check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * max(count.value, 1))()
    _check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    return [ctypes.c_void_p(nodes[i]) for i in range(count.value)]


def _fill_node(graph: int, memset: ctypes.c_void_p, func: ctypes.c_void_p) -> bool:
    """Replaces ``memset`` by a fill kernel node; False where it is left as it is."""
    cu = _cu()
    kind = ctypes.c_int(-1)
    _check(cu.cuGraphNodeGetType(memset, ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _NODE_MEMSET:
        return False
    p = _MemsetParams()
    _check(cu.cuGraphMemsetNodeGetParams(memset, ctypes.byref(p)), "cuGraphMemsetNodeGetParams")
    if p.elementSize not in (1, 2, 4) or p.width * p.height * p.elementSize > MAX_BYTES or p.width * p.height == 0:
        return False
    deps, plain_in = _edges(cu.cuGraphNodeGetDependencies_v2, memset)
    users, plain_out = _edges(cu.cuGraphNodeGetDependentNodes_v2, memset)
    if not (plain_in and plain_out):
        return False
    args = [ctypes.c_uint64(p.dst), ctypes.c_uint32(p.value), ctypes.c_uint32(p.elementSize),
            ctypes.c_uint64(p.width), ctypes.c_uint64(p.height), ctypes.c_uint64(p.pitch)]  # fmt: skip
    pointers = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    n = p.width * p.height
    k = _KernelParams(func=func, gridDimX=(n + _BLOCK - 1) // _BLOCK, gridDimY=1, gridDimZ=1, blockDimX=_BLOCK,
                      blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                      kernelParams=ctypes.cast(pointers, ctypes.c_void_p))  # fmt: skip
    node, graph_p = ctypes.c_void_p(), ctypes.c_void_p(graph)
    dep_array = (ctypes.c_void_p * max(len(deps), 1))(*deps)
    _check(cu.cuGraphAddKernelNode_v2(ctypes.byref(node), graph_p, dep_array, ctypes.c_size_t(len(deps)),
                                      ctypes.byref(k)), "cuGraphAddKernelNode_v2")  # fmt: skip
    if users:
        froms = (ctypes.c_void_p * len(users))(*([node.value] * len(users)))
        tos = (ctypes.c_void_p * len(users))(*users)
        result = cu.cuGraphAddDependencies_v2(graph_p, froms, tos, None, ctypes.c_size_t(len(users)))
        if result != 0:  # a fill without the memset's successors would race them: take it out
            cu.cuGraphDestroyNode(node)
            _check(result, "cuGraphAddDependencies_v2")
    # With the memset still there too, the graph is right (both write the same bytes, between
    # the same nodes), only not faster.
    _check(cu.cuGraphDestroyNode(memset), "cuGraphDestroyNode")
    return True


def as_kernel_nodes(graph: torch.cuda.CUDAGraph) -> int:
    """Rewrites the small memset nodes of ``graph`` (captured with ``keep_graph=True``, not yet
    instantiated) as fill kernel nodes; returns how many. On any driver error it stops, logs,
    and returns what it did: a node either is rewritten whole or stays the memset it was."""
    try:
        raw, _ = graph.raw_cuda_graph(), _cu()  # no driver: OSError, before torch.cuda is asked
        func = _fill_function()
        done = sum(_fill_node(raw, node, func) for node in _graph_nodes(raw))
    except (OSError, AttributeError, RuntimeError) as exc:
        log.info("fsg: the captured graph's memset nodes stay memsets (%s: %s)", type(exc).__name__, exc)
        return 0
    log.info("fsg: %d memset nodes of the captured step run as kernel nodes", done)
    return done
