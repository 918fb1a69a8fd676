"""Precision policies on a mesh: FP8 where the sharded step equals the unsharded one, refused elsewhere."""

import pytest

from tests.dist import precision_workers


def test_tensorwise_float8_on_a_mesh_is_refused_at_compile_step(ranks):
    for message in ranks(2).run(precision_workers.float8_on_a_mesh_is_refused):
        assert message.startswith("UnsupportedError") and "one scale per tensor on a mesh" in message
        assert "recipe='rowwise'" in message


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_rowwise_float8_on_data_parallel_and_fsdp_equals_the_unsharded_step(ranks, preset):
    """A rank's token rows and (gathered) weight channels are the unsharded step's, so are their
    scales: the dp=2 step stays within the tolerance the bf16 steps of tests/dist are held to."""
    group = ranks(2)
    assert group.run(precision_workers.rowwise_matches_unsharded, {"dp": 2}, preset, "bf16") == [(0, 0), (0, 0)]
    counts = group.run(precision_workers.rowwise_matches_unsharded, {"dp": 2}, preset, "rowwise")
    assert counts[0] == counts[1] and counts[0][0] >= 8  # forward and grad-input of qkv, proj, fc, fc_proj
    assert counts[0][1] >= 1  # the MLP's GELU gradient: cast and bias sums fused (kernels/float8_cast.py)


def test_rowwise_float8_under_tensor_parallel_is_refused_naming_the_parameter(ranks):
    for message in ranks(2).run(precision_workers.rowwise_under_tensor_parallel_is_refused, {"tp": 2}):
        assert message.startswith("UnsupportedError") and "is sharded where it is used" in message
        assert "params" in message and "tensor parallel" in message
