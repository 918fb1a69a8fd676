"""What the kernel tests share: when they can run, and their hypothesis settings."""

import os

import pytest
from hypothesis import settings

from tests.helpers import rel_err as rel  # noqa: F401 - re-exported for the kernel tests

needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="these tests run the kernels on CPU tensors under TRITON_INTERPRET=1 (the root "
    "conftest sets it on machines without a GPU); on a GPU machine tests/gpu covers them",
)
KERNEL = settings(max_examples=10, deadline=None)
