"""The kernel tests run the Triton kernels on CPU tensors in Triton's interpreter."""

import pytest

from fsg._src.kernels._common import cpu_interpreter


@pytest.fixture(autouse=True)
def _interpret_on_cpu():
    with cpu_interpreter():
        yield
