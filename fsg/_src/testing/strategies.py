"""Hypothesis strategies for meshes and partition specs."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from fsg._src.mesh import P


def _factorizations(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


@st.composite
def mesh_strategy(draw, world_size: int, *, names: tuple[str, str] = ("dp", "tp")) -> dict[str, int]:
    """Mesh axes (``{name: size}``) whose sizes multiply to ``world_size``: 1-D over either
    name, or 2-D over both.

    Example:
      >>> from hypothesis import given
      >>> @given(fsg.testing.mesh_strategy(4))
      ... def test(axes): assert math.prod(axes.values()) == 4
    """
    if draw(st.booleans()):
        return {draw(st.sampled_from(names)): world_size}
    a, b = draw(st.sampled_from(_factorizations(world_size)))
    return {names[0]: a, names[1]: b}


@st.composite
def spec_strategy(draw, shape: tuple[int, ...], axes: dict[str, int]) -> P:
    """A valid partition spec for a tensor of ``shape`` on a mesh with ``axes``: each axis
    shards at most one dim, only dims it divides (the product, for several axes on a dim).

    Example:
      >>> from hypothesis import given
      >>> @given(fsg.testing.spec_strategy((8, 6), {"dp": 2, "tp": 3}))
      ... def test(spec): assert len(spec) <= 2
    """
    entries: list = [None] * len(shape)
    for name, size in axes.items():
        choices = [None] + [
            d for d in range(len(shape)) if shape[d] % (size * math.prod(axes[n] for n in _names(entries[d]))) == 0
        ]
        d = draw(st.sampled_from(choices))
        if d is not None:
            entries[d] = _names(entries[d]) + (name,)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*[e if e is None or len(e) > 1 else e[0] for e in entries])


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else entry
