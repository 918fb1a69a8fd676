"""The multi-rank tests of the pipeline share tests/dist's pools of gloo ranks."""

from tests.dist.conftest import ranks as ranks  # noqa: F401 - a fixture, found by name
