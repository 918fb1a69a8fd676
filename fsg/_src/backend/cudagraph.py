"""Whole-step CUDA-graph replay of a compiled, donated step.

A donated step writes every new state leaf into the old one's storage, so the state already
lives in static buffers; the batch is copied into buffers the graph owns. Call 1 compiles and
runs the step; call 2 runs it once on a side stream (the warm-up CUDA graphs need) and then
captures it; every later call copies the batch in and replays the whole step (forward,
backward, optimizer) as one graph: no Python, no per-kernel launch cost.

The graph is tied to the state's storages. A call with other state tensors (a restored
checkpoint, a new ``step.init``) is captured again; the metrics returned are copies, so a
later replay never overwrites what a caller kept. If the capture fails (an op in the step that
CUDA graphs cannot hold), the step warns once with ``CudaGraphWarning`` and runs on without
replay, unless ``cuda_graph=True`` asked for replay, which makes it an error.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from typing import Callable

import torch

from fsg._src import distributed
from fsg._src.errors import CudaGraphWarning, UnsupportedError
from fsg._src.kernels._common import capture_warmup, graph_owns

log = logging.getLogger("fsg")


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every GraphedStep, for release_all


def release_all() -> int:
    """Drops every captured step graph (after the device finishes its work); returns how many.
    ``fsg.distributed.shutdown`` calls it first: tearing NCCL down while graphs that captured
    its kernels are alive can hang (pytorch/pytorch#115388). A released step captures again
    on its next call."""
    graphed = [g for g in _LIVE if g.captured]
    if graphed:
        torch.cuda.synchronize()
    for g in graphed:
        g.release()
    return len(graphed)


distributed.before_shutdown(release_all)


def can_graph(inputs: list[torch.Tensor]) -> bool:
    """Whether a step on ``inputs`` can be replayed as a CUDA graph: every input on CUDA."""
    return bool(inputs) and all(t.is_cuda for t in inputs)


def wanted(cuda_graph: bool | None, *, on_mesh: bool, donate: bool, leaves: list) -> bool:
    """Whether a compiled step is replayed as a CUDA graph: by default whenever it can be on
    one device (donated state, everything on CUDA); ``cuda_graph=True`` insists, and also
    replays a step on a mesh, collectives included (experimental)."""
    if cuda_graph is False:
        return False
    reason = None
    if on_mesh and cuda_graph is None:
        # Experimental: replaying NCCL collectives inside a graph works, but is opt-in.
        reason = "the step runs on a mesh (replay with collectives is opt-in: cuda_graph=True)"
    elif not donate:
        reason = "donate=False (replay needs the state in fixed buffers)"
    elif not can_graph(leaves):
        reason = "some state or batch leaf is not a CUDA tensor"
    if cuda_graph and reason is not None:
        raise UnsupportedError(f"cuda_graph=True, but {reason}; pass cuda_graph=None or False")
    return reason is None


class GraphedStep:
    """Wraps a compiled donated step ``fn(*state_leaves, *batch_leaves) -> metrics``."""

    def __init__(self, fn: Callable[..., tuple], num_state: int, *, strict: bool = False):
        self._fn = fn
        self._strict = strict  # re-raise a failed capture instead of running on without graphs
        self._disabled = False
        self._num_state = num_state
        self._calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._key: tuple = ()
        self._batch: list[torch.Tensor] = []
        self._outputs: tuple = ()
        self._owned: list = []
        _LIVE.add(self)

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def release(self) -> None:
        """Drops the captured graph and its buffers; the next call captures again."""
        self._graph, self._key, self._outputs, self._batch, self._calls = None, (), (), [], 1
        self._owned = []

    def _key_of(self, inputs) -> tuple:
        state = inputs[: self._num_state]
        batch = inputs[self._num_state :]
        return (tuple(t.data_ptr() for t in state), tuple((t.shape, t.dtype, t.device) for t in batch))

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        if self._disabled:
            return self._fn(*inputs)
        key = self._key_of(inputs)
        if self._graph is not None and key == self._key:
            for buf, x in zip(self._batch, inputs[self._num_state :]):
                buf.copy_(x, non_blocking=True)
            self._graph.replay()
            return tuple(o.clone() for o in self._outputs)
        self._calls += 1
        if self._calls == 1:  # compiles (torch.compile is lazy) and runs the step
            return self._fn(*inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # Each run's freed temporaries stay cached for the stream that ran it: call 1's for the
        # current stream, the warm-up's for `side`, and the capture allocates a private pool of
        # its own, so without these the allocator could hold three steps' activations (the
        # likely cause of 15.6 GiB reserved for an 8.4 GiB peak, GPT-2 124M on an H200). Each
        # run's cache goes back to the driver before the next run allocates.
        torch.cuda.empty_cache()
        with torch.cuda.stream(side), capture_warmup():  # the warm-up is this call's real step
            outputs = self._fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.empty_cache()
        try:
            t0 = time.perf_counter()
            self._capture(inputs, key)
            log.info("fsg: captured the step as a CUDA graph in %.1f s", time.perf_counter() - t0)
        except Exception as exc:
            if self._strict:
                raise
            self._graph, self._disabled = None, True
            warnings.warn(
                f"fsg: capturing the step as a CUDA graph failed ({type(exc).__name__}: {exc}); the step "
                f"runs without graph replay from now on. Pass cuda_graph=False to skip the attempt, "
                f"or cuda_graph=True to make this an error.",
                CudaGraphWarning,
                stacklevel=3,
            )
        return outputs

    def _capture(self, inputs, key) -> None:
        # the same strides (not just shapes): the compiled step guards on them
        batch = inputs[self._num_state :]
        self._batch = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in batch]
        for buf, x in zip(self._batch, batch):
            buf.copy_(x)
        self._graph, self._owned = None, []  # release an old graph's pool before capturing a new one
        graph, owned = torch.cuda.CUDAGraph(), []  # owned: what the graph's kernels read (tables)
        with torch.cuda.graph(graph), graph_owns(owned):  # records only: the state is not touched here
            self._outputs = tuple(self._fn(*inputs[: self._num_state], *self._batch))
        self._graph, self._key, self._owned = graph, key, owned
