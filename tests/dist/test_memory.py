"""``Lowered.memory()`` on a mesh counts each rank's local graph: its shards of the state, its
rows of the batch, and the collectives' buffers, exactly as the graph holds them when run."""

import functools

import pytest

import fsg
import fsg.sharding
import fsg.testing
from tests.helpers import mlp, mse_loss_fn, regression_batch
from tests.test_memory import measured_peak


def memory_of(preset: str, accum_steps: int) -> tuple:
    """On every rank: the memory of the local graph, the peak it measures when run eagerly, and
    the memory of the same step unsharded on the rank's 8 rows."""
    model = mlp(d_in=8, d_hidden=32, d_out=4)
    rules = fsg.sharding.fsdp("dp") if preset == "fsdp" else fsg.sharding.data_parallel()
    kwargs = {"optimizer": fsg.optim.adamw(0.1), "backend": "eager", "accum_steps": accum_steps}
    step = fsg.compile_step(
        mse_loss_fn(model), fsg.testing.mesh({"dp": 2}), param_sharding=rules, batch_sharding=fsg.P("dp"), **kwargs
    )
    lowered = step.lower(step.init(fsg.params(model)), regression_batch(n=16))
    alone = fsg.compile_step(mse_loss_fn(model), **kwargs)
    single = alone.lower(alone.init(fsg.params(model)), regression_batch(n=8)).memory()
    return lowered.memory(), measured_peak(lowered, runs=3), single


@functools.cache
def _results(ranks, preset: str, accum_steps: int) -> tuple:
    first, second = ranks(2).run(memory_of, preset, accum_steps)
    assert (first[0], first[2]) == (second[0], second[2])  # the ranks' graphs are alike
    return first


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_each_rank_counts_its_shards_and_rows_and_holds_what_it_counts(ranks, accum_steps):
    dp, dp_measured, single = _results(ranks, "dp", accum_steps)
    fsdp, fsdp_measured, _ = _results(ranks, "fsdp", accum_steps)
    assert dp.state == single.state and dp.batch == single.batch  # replicated state, half the rows
    assert fsdp.state < 0.55 * dp.state and fsdp.batch == dp.batch  # params and moments halved
    for static, measured in ((dp.temporaries_peak, dp_measured), (fsdp.temporaries_peak, fsdp_measured)):
        assert measured <= static <= 1.05 * measured


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_a_data_parallel_rank_saves_the_activations_of_its_rows(ranks, accum_steps):
    dp, _, single = _results(ranks, "dp", accum_steps)
    # the unsharded step's on the rank's rows, and the loss's all-reduce (a scalar)
    assert 0 <= dp.activations - single.activations <= 8
