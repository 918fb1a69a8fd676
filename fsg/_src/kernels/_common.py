"""Helpers shared by the kernel families."""

from __future__ import annotations

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
