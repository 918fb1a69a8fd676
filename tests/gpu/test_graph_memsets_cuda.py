"""The captured step graph's memset nodes as fill kernel nodes (skipped without a GPU): the
bytes each memset wrote, in the order the graph's kernels read them, from memsets of every
element size and a pitched one; cuBLAS's own; a GPT step replayed with and without."""

import ctypes
import logging

import pytest
import torch

from fsg._src.backend import graph_memsets as M
from tests.helpers import gpt_bf16_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _node_types(graph: torch.cuda.CUDAGraph) -> list[int]:
    kinds = []
    for node in M._graph_nodes(graph.raw_cuda_graph()):
        kind = ctypes.c_int(-1)
        assert M._cu().cuGraphNodeGetType(node, ctypes.byref(kind)) == 0
        kinds.append(kind.value)
    return kinds


def _captured(record) -> torch.cuda.CUDAGraph:
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        record(torch.cuda.current_stream().cuda_stream)
    return graph


def test_fills_write_what_the_memsets_wrote_where_and_when_they_did():
    """Each memset (8-, 16-, 32-bit values, a pitched 2-D one, one past MAX_BYTES left alone)
    stands between a kernel that writes its buffer before it and one that reads it after: the
    rewritten graph, replayed twice over scribbled buffers, leaves every byte as the memsets do."""
    cu = M._cu()
    bufs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (4, 10, 64, 4096, M.MAX_BYTES + 256)]
    after = [torch.empty_like(b, dtype=torch.int32) for b in bufs]
    u64 = ctypes.c_uint64

    def record(stream):
        for b in bufs:
            b.fill_(0x5A)  # a kernel writes the buffer first
        assert cu.cuMemsetD8Async(u64(bufs[0].data_ptr()), ctypes.c_ubyte(0), ctypes.c_size_t(4), ctypes.c_void_p(stream)) == 0
        assert cu.cuMemsetD16Async(u64(bufs[1].data_ptr()), ctypes.c_ushort(0xBEEF), ctypes.c_size_t(5), ctypes.c_void_p(stream)) == 0
        assert cu.cuMemsetD32Async(u64(bufs[2].data_ptr()), ctypes.c_uint(0x01020304), ctypes.c_size_t(16), ctypes.c_void_p(stream)) == 0
        # 3 rows of 5 32-bit values, rows 1024 bytes apart: the bytes between rows keep 0x5A
        assert cu.cuMemsetD2D32Async(u64(bufs[3].data_ptr()), ctypes.c_size_t(1024), ctypes.c_uint(0xFFFFFFFF),
                                     ctypes.c_size_t(5), ctypes.c_size_t(3), ctypes.c_void_p(stream)) == 0  # fmt: skip
        assert cu.cuMemsetD8Async(u64(bufs[4].data_ptr()), ctypes.c_ubyte(7), ctypes.c_size_t(bufs[4].numel()), ctypes.c_void_p(stream)) == 0
        for b, a in zip(bufs, after):
            a.copy_(b.int() + 1)  # a kernel reads it after

    def expected():
        want = [b.new_full(b.shape, 0x5A) for b in bufs]
        want[0][:] = 0
        want[1][:10].view(torch.int16)[:] = torch.tensor(0xBEEF, dtype=torch.int32).to(torch.int16)
        want[2].view(torch.int32)[:] = 0x01020304
        for row in range(3):
            want[3][row * 1024 : row * 1024 + 20] = 0xFF
        want[4][:] = 7
        return want

    record(torch.cuda.current_stream().cuda_stream)  # warm-up, outside the capture
    graph = _captured(record)
    before = _node_types(graph).count(M._NODE_MEMSET)  # 5, and any of torch's own
    done = M.as_kernel_nodes(graph)
    assert before >= 5 and done >= 4
    assert _node_types(graph).count(M._NODE_MEMSET) == before - done >= 1  # the one past MAX_BYTES
    graph.instantiate()
    for _ in range(2):
        for b, a in zip(bufs, after):
            b.fill_(0x11), a.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        for b, a, w in zip(bufs, after, expected()):
            assert torch.equal(b, w)
            assert torch.equal(a, w.int() + 1)


def test_cublas_gemms_with_their_memsets_rewritten_compute_the_same_bits():
    """GPT-2 124M's matmul shapes in bf16 (cuBLAS zeroes a counter before each cooperative GEMM
    on Hopper): the rewritten graph's products equal the plain graph's bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(16384, 768, 2304), (16384, 768, 3072), (16384, 3072, 768), (768, 16384, 3072), (16384, 768, 768)]
    ops = [(torch.randn(m, k, device="cuda", generator=g).bfloat16(), torch.randn(k, n, device="cuda", generator=g).bfloat16())
           for m, k, n in shapes]  # fmt: skip
    outs = {}
    [a @ b for a, b in ops]  # warm-up: cuBLAS's handle and workspace, outside the capture
    for rewrite in (False, True):
        res = []
        graph = _captured(lambda stream: res.extend(a @ b for a, b in ops))
        rewritten = M.as_kernel_nodes(graph) if rewrite else 0
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        outs[rewrite] = [r.clone() for r in res]
        print("memsets rewritten:", rewritten, "memset nodes left:", _node_types(graph).count(M._NODE_MEMSET))
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))


def test_a_gpt_step_replayed_with_fill_nodes_trains_as_with_memsets_cuda(monkeypatch, caplog):
    """The captured GPT step (call 2 captures, calls 3-5 replay) with and without the rewrite:
    the same losses and parameters, and the log says how many nodes changed."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 512, (8, 257), generator=g) for _ in range(5)]
    config = dict(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=256)
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(M, "ENABLED", enabled)
        with caplog.at_level(logging.INFO, logger="fsg"):
            results[enabled] = gpt_bf16_steps(config, rows, "cuda")
    said = [r.getMessage() for r in caplog.records if "memset nodes of the captured step" in r.getMessage()]
    print(said)
    assert len(said) == 1 and not said[0].startswith("fsg: 0 ")
    (_, losses, params), (_, losses_plain, params_plain) = results[True], results[False]
    assert max(abs(a - b) for a, b in zip(losses, losses_plain)) < 1e-3
    assert all(torch.allclose(params[k], params_plain[k], rtol=1e-3, atol=1e-4) for k in params)
