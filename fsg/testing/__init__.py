"""Testing utilities for users' own tests: multi-rank harness, equivalence check, strategies.

The hypothesis strategies (``mesh_strategy``, ``spec_strategy``) need hypothesis, which is
optional (``pip install hypothesis``, or the ``fsg[test]`` extra); they are imported when
first used, so the rest of this module works without it.
"""

from typing import TYPE_CHECKING

from fsg._src.runtime.verify import verify_step as verify_step
from fsg._src.testing.equivalence import assert_sharded_matches_unsharded as assert_sharded_matches_unsharded
from fsg._src.testing.harness import MultiRank as MultiRank
from fsg._src.testing.harness import RankError as RankError
from fsg._src.testing.harness import mesh as mesh

if TYPE_CHECKING:
    from fsg._src.testing.strategies import mesh_strategy as mesh_strategy
    from fsg._src.testing.strategies import spec_strategy as spec_strategy

__all__ = [
    "MultiRank",
    "RankError",
    "assert_sharded_matches_unsharded",
    "mesh",
    "mesh_strategy",
    "spec_strategy",
    "verify_step",
]

_NEED_HYPOTHESIS = ("mesh_strategy", "spec_strategy")


def __getattr__(name: str):
    if name not in _NEED_HYPOTHESIS:
        raise AttributeError(f"module 'fsg.testing' has no attribute {name!r}")
    try:
        from fsg._src.testing import strategies
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "hypothesis":
            raise
        raise ImportError(
            f"fsg.testing.{name} is a hypothesis strategy, and hypothesis is not installed: "
            'pip install hypothesis (or pip install "fsg[test]")'
        ) from exc
    return getattr(strategies, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NEED_HYPOTHESIS))
