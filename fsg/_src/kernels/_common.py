"""Helpers shared by the kernel families."""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
import triton


def use_triton(x: torch.Tensor) -> bool:
    """Whether to launch the Triton kernel for ``x``: on CUDA, and on CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``, the CPU tests); otherwise the eager reference runs."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def row_block(n: int) -> int:
    """The block size of a one-row-per-program kernel over rows of width ``n``."""
    return triton.next_power_of_2(n)


_PLAIN_MATH = contextvars.ContextVar("fsg_plain_math", default=False)


@contextlib.contextmanager
def plain_math():
    """Within this context ``fsg.nn`` traces its eager references instead of the fused ops.

    Stage 2 shards the traced graph with DTensor, which has sharding rules for torch's ops but
    not for fsg's opaque kernels; a step on a mesh is therefore traced in plain math.
    """
    token = _PLAIN_MATH.set(True)
    try:
        yield
    finally:
        _PLAIN_MATH.reset(token)


def fused_ops_enabled() -> bool:
    """False inside ``plain_math()``."""
    return not _PLAIN_MATH.get()


_CAPTURE_WARMUP = contextvars.ContextVar("fsg_capture_warmup", default=False)


@contextlib.contextmanager
def capture_warmup():
    """Marks the warm-up run before a CUDA-graph capture: kernels take the launch path they
    will take while capturing, so that every Triton kernel the capture needs is already built
    and loaded (building one during a capture is not allowed)."""
    token = _CAPTURE_WARMUP.set(True)
    try:
        yield
    finally:
        _CAPTURE_WARMUP.reset(token)


def graph_safe_launch(x: torch.Tensor) -> bool:
    """Whether a kernel on ``x`` must launch without host-to-device uploads: while a CUDA
    graph is captured, or in the warm-up run before one."""
    return _CAPTURE_WARMUP.get() or (x.is_cuda and torch.cuda.is_current_stream_capturing())
