"""Complex parameters on a mesh: the sharded step equals the unsharded one (the optimizer
sees their real views on every rank, as on one device)."""

import pytest

from tests.dist import complex_workers


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_complex_params_on_a_mesh(ranks, preset, optimizer):
    assert all(ranks(2).run(complex_workers.complex_params_on_a_mesh, {"dp": 2}, preset, optimizer))
