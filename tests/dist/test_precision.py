"""Precision policies on a mesh: what is refused before anything is traced."""

from tests.dist import precision_workers


def test_float8_on_a_mesh_is_refused_at_compile_step(ranks):
    for message in ranks(2).run(precision_workers.float8_on_a_mesh_is_refused):
        assert message.startswith("UnsupportedError") and "FP8 matmuls on a mesh are not built yet" in message
