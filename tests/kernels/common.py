"""What the kernel tests share: when they can run, and their hypothesis settings."""

import os

import pytest
import torch
from hypothesis import settings

from tests.helpers import rel_err as rel  # noqa: F401 - re-exported for the kernel tests

needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="CPU runs need TRITON_INTERPRET=1 (the root conftest sets it without a GPU)",
)
KERNEL = settings(max_examples=10, deadline=None)
