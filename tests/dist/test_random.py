"""Keyed random ops on a mesh (issue 21): the random values are computed from global element
indices, so each rank draws exactly what the unsharded step draws, and the sharded step equals
the unsharded one with dropout on. Real gloo process groups on CPU."""

import pytest

from tests.dist import random_workers


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mlp_sharded_matches_unsharded(ranks, preset, p):
    losses = ranks(2).run(random_workers.check_dropout, {"dp": 2}, preset, p)
    assert losses[0] == losses[1]  # the loss metric is replicated
    assert losses[0] != random_workers.plain_loss({"dp": 2})  # the masks dropped something


def test_dropout_with_accumulation_and_every_keyed_op_sharded_matches_unsharded(ranks):
    ranks(2).run(random_workers.check_dropout, {"dp": 2}, "fsdp", 0.3, 2, True)


def test_dropout_under_tensor_parallelism_matches_unsharded(ranks):
    """Activations sharded on the hidden dim: the replicated mask is sliced the same way."""
    ranks(2).run(random_workers.check_dropout, {"tp": 2}, "tp", 0.3)
