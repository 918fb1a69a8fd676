"""``compile_step(..., verify=True)``: the first step checked sharded against unsharded."""

import pytest

from tests.dist import verify_workers


@pytest.mark.parametrize("world, axes, preset", [(2, {"dp": 2}, "fsdp"), (4, {"dp": 2, "tp": 2}, "fsdp_tp")])
def test_verify_passes_a_correct_step_and_leaves_training_unchanged(ranks, world, axes, preset):
    losses = ranks(world).run(verify_workers.verified_run_equals_plain_run, axes, preset)
    assert losses[0] == losses[-1] and losses[0][1] < losses[0][0]


def test_verify_catches_a_deliberately_wrong_sharding_rule(ranks):
    message, drift = ranks(2).run(verify_workers.verify_catches_a_wrong_rule, {"dp": 2})[0]
    assert drift > 1e-3  # unchecked, the wrong rule silently trains another model
    assert message.startswith("verify: the sharded step on Mesh({'dp': 2}) differs from the unsharded step")
    assert "max |difference|" in message and "tolerance 1e-09" in message
