"""Stage 4: compile the step graph."""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

BACKENDS = ("inductor", "aot_eager", "eager")


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
    return torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
