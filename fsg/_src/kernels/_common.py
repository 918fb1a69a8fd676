"""Helpers shared by the kernel families."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import types

import torch


class _KernelWithoutTriton:
    """What ``@triton.jit`` makes of a kernel when triton is missing: the module still imports,
    and a launch (never reached: ``use_triton`` is False) says what is missing."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise ModuleNotFoundError(
            f"the Triton kernel {self.fn.__name__} needs triton, which is not installed: "
            "pip install triton (or the fsg[triton] extra)"
        )


try:
    import triton
    import triton.language as tl
except ImportError as exc:  # triton is optional (DESIGN.md section 3): the eager references run
    logging.getLogger("fsg").info(
        "fsg: triton is not importable (%s): fused Triton kernels off, each op runs its eager reference math", exc
    )
    # Import-time stand-ins, as torch's _inductor/runtime/triton_compat.py has: each module's
    # `@triton.jit` still defines its kernels; `tl` is only read inside kernels (and in string
    # annotations), which nothing runs without triton.
    triton = types.SimpleNamespace(jit=_KernelWithoutTriton)
    tl = None

HAS_TRITON = tl is not None
"""Whether triton could be imported; without it ``use_triton`` is always False."""


_CPU_INTERPRETER = contextvars.ContextVar("fsg_cpu_interpreter", default=False)


def cpu_interpreter():
    """Within this context, kernels on CPU tensors run in Triton's interpreter (when
    ``TRITON_INTERPRET=1`` was set before triton was imported): how the CPU tests check the
    kernels. Outside it CPU tensors take the eager reference, which is far faster."""
    return _flag(_CPU_INTERPRETER)


def use_triton(x: torch.Tensor) -> bool:
    """Whether to launch the Triton kernel for ``x``: on CUDA, and on CPU inside
    ``cpu_interpreter()`` under ``TRITON_INTERPRET=1`` (the CPU tests); otherwise the eager
    reference runs (always, without triton)."""
    return HAS_TRITON and (x.is_cuda or (_CPU_INTERPRETER.get() and os.environ.get("TRITON_INTERPRET") == "1"))


@triton.jit
def row_tile(first_row, M, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``(rows, row_ok, mask, offs)`` of the tile of ``ROWS`` rows starting at ``first_row``
    of a contiguous ``[M, N]`` tensor, ``BLOCK`` columns wide (int64 offsets)."""
    rows = first_row.to(tl.int64) + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < M
    return rows, row_ok, row_ok[:, None] & (cols < N)[None, :], rows[:, None] * N + cols[None, :]


class RowTiling:
    """How a row-wise kernel over ``[M, N]`` tiles its work: each program holds ``rows`` rows
    of ``block`` columns at once (about 4096 elements, so narrow rows still fill the warps)
    and, in a backward, walks ``iters`` such tiles, summing its weight-gradient partials in
    registers; ``programs`` partial rows are left for one ``column_sum`` launch."""

    def __init__(
        self,
        M: int,
        N: int,
        *,
        backward: bool = False,
        iters: int | None = None,
        rows: int | None = None,
        num_warps: int | None = None,
        stages: int = 1,
    ):
        self.block = triton.next_power_of_2(N)
        self.rows = rows or max(1, min(16, 4096 // self.block))
        self.iters = iters or (4 if backward and 2048 * self.rows <= M else 1)
        # 4 warps for rows up to 1024 wide: 8 made the width-768 backward 2x slower (H200 sweep,
        # benchmarks/RESULTS.md); wider rows take one warp per 512 elements of the tile.
        self.num_warps = num_warps or (4 if self.block <= 1024 else min(16, max(4, self.rows * self.block // 512)))
        self.programs = triton.cdiv(M, self.rows * self.iters)
        self.stages = stages  # the row loop's software-pipeline depth (``tl.range(num_stages=)``)


@contextlib.contextmanager
def _flag(var: contextvars.ContextVar):
    token = var.set(True)
    try:
        yield
    finally:
        var.reset(token)


_PLAIN_MATH = contextvars.ContextVar("fsg_plain_math", default=False)


def plain_math():
    """Within this context ``fsg.nn`` traces its eager references instead of the fused ops
    that have no DTensor sharding rule.

    Stage 2 shards the traced graph with DTensor, which has sharding rules for torch's ops but
    not for fsg's opaque kernels; a step on a mesh is therefore traced in plain math, except
    the ops given rules in ``dtensor_rules.py`` (``linear_cross_entropy``).
    """
    return _flag(_PLAIN_MATH)


def fused_ops_enabled() -> bool:
    """False inside ``plain_math()``."""
    return not _PLAIN_MATH.get()


_CAPTURE_WARMUP = contextvars.ContextVar("fsg_capture_warmup", default=False)


def capture_warmup():
    """Marks the warm-up run before a CUDA-graph capture: kernels launch what they will launch
    while capturing, so that every Triton kernel the capture needs is already built and loaded,
    and set aside what the capture cannot allocate (building a kernel or allocating pinned
    memory during a capture is not allowed)."""
    return _flag(_CAPTURE_WARMUP)


def in_capture_warmup() -> bool:
    """Whether this is the warm-up run before a CUDA-graph capture (see ``capture_warmup``)."""
    return _CAPTURE_WARMUP.get()


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_KEEP_ALIVE: contextvars.ContextVar[list | None] = contextvars.ContextVar("fsg_graph_keep_alive", default=None)
_KEPT_FOR_OTHER_GRAPHS: list = []  # captures fsg did not start: their lifetime is unknown here


@contextlib.contextmanager
def graph_owns(objects: list):
    """Within this context (a capture), ``keep_alive`` puts objects into ``objects``, which the
    caller keeps exactly as long as the graph: what the graph reads at replay (a pinned host
    buffer, a device table) must outlive it."""
    token = _KEEP_ALIVE.set(objects)
    try:
        yield
    finally:
        _KEEP_ALIVE.reset(token)


def keep_alive(obj) -> None:
    """Keeps ``obj`` alive as long as the CUDA graph being captured (for the process when the
    capture is not fsg's own)."""
    owner = _KEEP_ALIVE.get()
    (_KEPT_FOR_OTHER_GRAPHS if owner is None else owner).append(obj)
