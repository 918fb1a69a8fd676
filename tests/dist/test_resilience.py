"""Non-finite steps on a mesh: one rank's NaN or Inf skips the step on every rank."""

import pytest
import torch

from tests.dist import resilience_workers


@pytest.mark.parametrize("preset, poison", [("dp", "data"), ("fsdp", "grad")])
def test_a_nan_on_one_rank_skips_the_step_on_both_and_replicas_stay_identical(ranks, preset, poison):
    results = ranks(2).run(resilience_workers.nan_on_one_rank_is_skipped_everywhere, {"dp": 2}, preset, poison)
    for r in results:
        assert r["skipped"] == 1 and r["kept"]  # counted once; params and optimizer state unchanged
    for a, b in zip(results[0]["after"] + results[0]["final"], results[1]["after"] + results[1]["final"]):
        assert torch.equal(a, b)  # the ranks never diverge, during the skip or after it
    assert results[0]["last_loss"] == results[1]["last_loss"]
