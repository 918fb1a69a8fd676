"""Rank functions of tests/dist/test_zero_dim_mesh.py: 0-d leaves trained on a mesh equal eager."""

from __future__ import annotations

import fsg
import fsg.sharding
import fsg.testing
from tests import test_zero_dim as zd

PRESETS = {"dp": fsg.sharding.data_parallel, "fsdp": fsg.sharding.fsdp}


def check(axes: dict, preset: str, ranks: tuple[int, ...], optimizer: str, accum_steps: int) -> int:
    whole = accum_steps == 1
    got = zd.trained(
        ranks, optimizer, whole, fsg.testing.mesh(axes), scale=whole, backend="aot_eager",
        param_sharding=PRESETS[preset](), accum_steps=accum_steps,  # the default batch sharding
    )  # fmt: skip
    zd.assert_equal(got, zd.eager(ranks, optimizer, whole, scale=whole))
    return len(ranks)
