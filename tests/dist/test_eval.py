"""fsg.compile_eval on a mesh equals the unsharded evaluation (issue 21): BatchNorm on its
running statistics, dropout off, on 2 gloo ranks."""

import pytest

from tests.dist import eval_workers


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_eval_on_two_ranks_matches_unsharded(ranks, preset):
    ranks(2).run(eval_workers.check_eval_matches_unsharded, preset)


def test_eval_refuses_a_state_placed_by_other_rules(ranks):
    ranks(2).run(eval_workers.check_eval_refuses_other_param_sharding)
