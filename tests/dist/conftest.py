"""Pools of gloo ranks shared by all multi-rank tests of a session (started on first use).

A test on a pool runs once more, on a fresh pool, if one of its ranks' *processes died*
(``ProcessDied`` in the ``RankError``: a signal, no Python error), and only then: gloo's
worker thread (``pt_gloo_runloop``) crashed once in libc in ~15 full runs, in the project's
CI (a general protection fault, kernel log 2026-12-04), while the surviving rank saw only
"Connection reset by peer". A test that fails twice fails; a rerun shows as ``R`` in the
summary with the death's report (signal, faulthandler stacks). A Python error on any rank,
wrong values included, is never rerun.
"""

import pytest

import fsg.testing

_POOLS: dict[int, fsg.testing.MultiRank] = {}
_DEATHS: list[tuple[str, str]] = []  # (test, the RankError's report) of each rerun


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        text = report.longreprtext
        _DEATHS.append((report.nodeid, text[text.find("RankError: ") :][:4000]))


def pytest_terminal_summary(terminalreporter):
    if _DEATHS:
        terminalreporter.section("rank processes that died (each test rerun once on a fresh pool)")
        for nodeid, text in _DEATHS:
            terminalreporter.write_line(f"{nodeid}:\n{text}")


def pytest_collection_modifyitems(items):
    for item in items:
        if "ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=["ProcessDied"]))


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
