"""backend/graph_memsets.py where no GPU is: the torch API it stands on, and a machine without
a CUDA driver (the rewrite itself is tested in tests/gpu/test_graph_memsets_cuda.py)."""

import ctypes
import inspect
import logging

import pytest
import torch

from fsg._src.backend import graph_memsets as M


def test_torch_keeps_the_graph_editable_until_instantiate():
    """The public (beta, torch 2.8+) API the rewrite needs: ``CUDAGraph(keep_graph=True)``,
    ``raw_cuda_graph()`` and ``instantiate()``."""
    assert "keep_graph" in inspect.signature(torch.cuda.CUDAGraph.__new__).parameters
    assert callable(torch.cuda.CUDAGraph.raw_cuda_graph) and callable(torch.cuda.CUDAGraph.instantiate)


def test_the_driver_structs_have_the_c_layout():
    """CUDA_MEMSET_NODE_PARAMS (40 bytes), CUDA_KERNEL_NODE_PARAMS_v2 (72), CUgraphEdgeData (8)."""
    assert ctypes.sizeof(M._MemsetParams) == 40 and M._MemsetParams.width.offset == 24
    assert ctypes.sizeof(M._KernelParams) == 72 and M._KernelParams.kernelParams.offset == 40
    assert ctypes.sizeof(M._EdgeData) == 8


def test_without_a_cuda_driver_the_graph_is_left_as_captured(monkeypatch, caplog):
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has a CUDA driver")
    except OSError:
        pass

    class Graph:  # what as_kernel_nodes reads of a torch.cuda.CUDAGraph
        def raw_cuda_graph(self):
            return 0

    monkeypatch.setattr(M, "_driver", None)
    with caplog.at_level(logging.INFO, logger="fsg"):
        assert M.as_kernel_nodes(Graph()) == 0
    assert any("memset nodes stay memsets (OSError" in r.getMessage() for r in caplog.records)
