"""Testing utilities for users' own tests: multi-rank harness, equivalence check, strategies."""

from fsg._src.equivalence import assert_sharded_matches_unsharded as assert_sharded_matches_unsharded
from fsg._src.harness import MultiRank as MultiRank
from fsg._src.harness import RankError as RankError
from fsg._src.harness import mesh as mesh
from fsg._src.strategies import mesh_strategy as mesh_strategy
from fsg._src.strategies import spec_strategy as spec_strategy

__all__ = ["MultiRank", "RankError", "assert_sharded_matches_unsharded", "mesh", "mesh_strategy", "spec_strategy"]
