"""The abstract signature a compiled step is specialized on (its cache key), and the messages
for a call that does not match it: which leaves changed (a recompile), or how the structure
differs (an error)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree

from fsg._src import tree
from fsg._src.errors import StructureMismatchError


class Signature(NamedTuple):
    """The abstract signature a compiled step is specialized on: the cache key."""

    state_def: optree.PyTreeSpec
    batch_def: optree.PyTreeSpec
    state_specs: tuple[tree.LeafSpec, ...]
    batch_specs: tuple[tree.LeafSpec, ...]


def describe_change(old: Signature, new: Signature, state: Any, batch: Any) -> str:
    """Names the leaves whose abstract value changed between two signatures."""
    changes = []
    for root, tree_, old_specs, new_specs in (
        ("state", state, old.state_specs, new.state_specs),
        ("batch", batch, old.batch_specs, new.batch_specs),
    ):
        for path, a, b in zip(tree.leaf_paths(tree_, root), old_specs, new_specs):
            if a != b:
                changes.append(f"{path}: {a} -> {b}")
    return "; ".join(changes) or "tree structure changed"


def structure_error(root: str, expected: optree.PyTreeSpec, got: Any) -> StructureMismatchError:
    want = tree.leaf_paths(tree.unflatten(expected, [0] * expected.num_leaves), root)
    have = tree.leaf_paths(got, root)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    detail = f"missing {missing}, unexpected {extra}" if missing or extra else f"{expected} vs {tree.flatten(got)[1]}"
    return StructureMismatchError(
        f"{root} does not have the structure the step was compiled for: {detail}. Every call must "
        f"pass a {root} with the same keys and nesting; shapes and dtypes may change (that "
        f"recompiles), structure may not. Build a new step with compile_step for another structure."
    )
