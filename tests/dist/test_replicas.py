"""Replica checks (docs/resilience.md#replica-checks): ranks holding the same shard of a state
leaf hold the same bytes, or ``ReplicaMismatchError`` names the leaf and the ranks."""

import pytest
import torch

import fsg
from fsg._src.errors import ReplicaMismatchError
from fsg._src.runtime.replicas import check_replicas, fingerprint
from tests.dist import replica_workers
from tests.helpers import mlp, mse_loss_fn


@pytest.mark.parametrize(
    "world, axes, layout, bad_rank, agree, differ",
    [
        (2, {"dp": 2}, "dp", 1, [0], [1]),  # replicated params: both ranks hold the whole leaf
        (4, {"dp": 2, "tp": 2}, "dp_tp", 3, [1], [3]),  # tp shard 1 is held by ranks 1 and 3
    ],
)
def test_a_one_ulp_change_on_one_rank_is_caught_naming_leaf_and_ranks(
    ranks, world, axes, layout, bad_rank, agree, differ
):
    results = ranks(world).run(replica_workers.clean_then_perturbed, axes, layout, "0.weight", bad_rank)
    for r in results:
        # a check of a state that is fine: one all_gather, nothing else
        assert r["counts"] == {"all_gather": 1}
        assert r["compared"] == r["leaves"]  # every leaf has a shard held by two ranks here
        for message in (r["standalone"], r["step"]):
            assert message.startswith("state.params['0.weight']")
            assert f"ranks {sorted(agree + differ)} hold the same shard" in message
            assert f"rank {differ} differs from rank {agree}" in message
    assert len({r["standalone"] for r in results}) == 1  # every rank raises the same error


def test_fsdp_shards_held_once_are_not_compared_but_replicated_leaves_are(ranks):
    results = ranks(4).run(replica_workers.perturbed_unreplicated_shard, {"dp": 4}, "0.weight")
    for r in results:
        # the perturbed FSDP shard passed: only the replicated leaves (step, rng, biases...) were compared
        assert 0 < r["compared"] < r["leaves"]
        assert r["step_leaf"].startswith("state.step, torch.int64[]")
        assert "rank [2] differs from ranks [0, 1, 3]" in r["step_leaf"]


def test_a_check_without_a_process_group_compares_nothing():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="eager", check_replicas=1)
    state = step.init(fsg.params(model))
    assert check_replicas(state) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fingerprints_change_with_one_ulp_of_any_element_and_with_swaps(dtype):
    t = torch.randn(3, 1000, dtype=torch.float64).to(dtype)
    base = fingerprint(t)
    assert torch.equal(base, fingerprint(t.clone()))
    for index in [0, 1, 1234, t.numel() - 1]:
        bumped = t.clone().view(-1)
        bumped[index] = torch.nextafter(bumped[index], torch.tensor(float("inf"), dtype=dtype))
        assert (fingerprint(bumped) != base).all(), index  # both sums see one word change
    swapped = t.clone().view(-1)
    swapped[[5, 9]] = swapped[[9, 5]]
    assert fingerprint(swapped)[0] == base[0] and fingerprint(swapped)[1] != base[1]  # order matters


def test_fingerprints_of_odd_sizes_and_dtypes():
    for t in [
        torch.tensor(True),
        torch.arange(3, dtype=torch.int8),
        torch.ones(3, dtype=torch.float16),
        torch.empty(0),
    ]:
        assert fingerprint(t).dtype == torch.int64 and fingerprint(t).shape == (2,)
    assert not torch.equal(
        fingerprint(torch.arange(3, dtype=torch.int8)), fingerprint(torch.zeros(3, dtype=torch.int8))
    )


@pytest.mark.parametrize("value", [-1, True, 2.5, "10"])
def test_check_replicas_option_is_validated(value):
    with pytest.raises(fsg.ArgumentError, match=r"compile_step\(check_replicas=...\) must be an int >= 0"):
        fsg.compile_step(mse_loss_fn(mlp()), optimizer=fsg.optim.sgd(0.1), check_replicas=value)


def test_replica_mismatch_error_is_an_fsg_error():
    assert issubclass(ReplicaMismatchError, fsg.FsgError)
