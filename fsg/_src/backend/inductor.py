"""Stage 4: compile the step graph."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from torch import fx

from fsg._src import _torch_private

BACKENDS = ("inductor", "aot_eager", "eager")

log = logging.getLogger("fsg")


def check_backend(backend: str) -> None:
    """Raises ``ValueError`` for a backend name fsg does not know."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def compile_graph(gm: fx.GraphModule, backend: str) -> Callable[..., tuple]:
    """Compiles the step graph with ``backend``.

    ``"inductor"`` generates fused kernels (Triton on GPU, C++ on CPU); ``"aot_eager"`` runs
    the same functionalized graph op by op, which is fast to build and good for debugging;
    ``"eager"`` runs the traced FX graph as it is, with no compiler at all. Compilation itself
    happens on the first call.
    """
    check_backend(backend)
    if backend == "eager":
        return gm
    if backend == "inductor":
        return InductorStep(gm)
    return torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)


class InductorStep:
    """The step graph compiled by Inductor on its first call.

    The graph is already an aten graph, so it goes to Inductor directly
    (``_torch_private.inductor_compile``): Dynamo does not trace it a second time, which was
    about a third of a warm start on the VM. Inductor specializes on the inputs' strides as well as their
    shapes; a call whose strides differ (a transposed batch, say) compiles once more for
    them, as ``torch.compile``'s guards would.
    """

    def __init__(self, gm: fx.GraphModule):
        self._gm = gm
        # A step with collectives keeps its node order: the overlap pass placed each gradient
        # collective right after its last input, and Inductor's peak-memory reordering moved
        # them all after the backward on two H200s (no overlap; benchmarks/RESULTS.md).
        has_collectives = any(_torch_private.is_collective(n.target) for n in gm.graph.nodes)
        self._options = {"config_patches": {"reorder_for_peak_memory": False}} if has_collectives else None
        self._compiled: dict[tuple, Callable[..., Any]] = {}
        self._last: tuple[tuple, Callable[..., Any]] | None = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        key = tuple(t.stride() for t in inputs)
        if self._last is not None and self._last[0] == key:
            return self._last[1](*inputs)
        fn = self._compiled.get(key)
        if fn is None:
            t0 = time.perf_counter()
            fn = self._compiled[key] = _torch_private.inductor_compile(self._gm, list(inputs), self._options)
            log.info("fsg: stage 4: Inductor compiled the step in %.1f s", time.perf_counter() - t0)
        self._last = (key, fn)
        return fn(*inputs)
