"""Bit shifts of batch-sharded tensors: torch 2.13's DTensor takes ``aten.__rshift__`` /
``__lshift__`` (``x >> k``) for in-place ops, by their trailing underscore, and returns ``x``
unchanged. Stage 1 lowers them to ``bitwise_right_shift`` / ``bitwise_left_shift`` on a mesh."""

import pytest

from tests.dist import shift_workers


@pytest.mark.parametrize("op", [">>", "<<"])
def test_shifted_ids_on_a_data_mesh_match_unsharded(ranks, op):
    ranks(2).run(shift_workers.check_shifts, {"dp": 2}, op)
