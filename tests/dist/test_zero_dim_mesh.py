"""0-d leaves (and leaves of every rank to 4) on data-parallel and FSDP meshes of two gloo ranks
train exactly as eager ``torch.optim`` does (issue 60); the one-device half is tests/test_zero_dim.py."""

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.dist import zero_dim_workers
from tests.test_zero_dim import OPTIMIZERS, ranks_strategy


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    preset=st.sampled_from(sorted(zero_dim_workers.PRESETS)),
    leaf_ranks=ranks_strategy,
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    accum_steps=st.sampled_from([1, 2]),
)
@example(preset="fsdp", leaf_ranks=(0, 2), optimizer="adamw", accum_steps=1)
@example(preset="dp", leaf_ranks=(0,), optimizer="sgd", accum_steps=2)
def test_0d_leaves_on_a_mesh_train_as_eager(ranks, preset, leaf_ranks, optimizer, accum_steps):
    results = ranks(2).run(zero_dim_workers.check, {"dp": 2}, preset, leaf_ranks, optimizer, accum_steps)
    assert results == [len(leaf_ranks)] * 2
