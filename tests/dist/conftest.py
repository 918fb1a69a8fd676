"""Pools of gloo ranks shared by all multi-rank tests of a session (started on first use)."""

import pytest

import fsg.testing

_POOLS: dict[int, fsg.testing.MultiRank] = {}


@pytest.fixture(scope="session")
def ranks():
    def get(world_size: int) -> fsg.testing.MultiRank:
        if world_size not in _POOLS or _POOLS[world_size].closed:  # a failure closes a pool
            _POOLS[world_size] = fsg.testing.MultiRank(world_size)
        return _POOLS[world_size]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
