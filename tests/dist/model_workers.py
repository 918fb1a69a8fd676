"""Rank functions for tests/dist/test_models.py (spawn-importable)."""

import fsg
import fsg.testing
from tests.dist.workers import preset_rules
from tests.models import hf_models


def check_hf(kind: str, axes: dict, preset: str) -> None:
    model = hf_models.make(kind)
    fsg.testing.assert_sharded_matches_unsharded(
        hf_models.loss_fn(model), fsg.params(model), hf_models.batches(2), fsg.testing.mesh(axes),
        optimizer=fsg.optim.adamw(1e-3), param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp"),
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip
