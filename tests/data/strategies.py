"""Hypothesis strategies for the fsg.data tests."""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st


class LoaderCase(NamedTuple):
    """A loader over ``arange(num_tokens)`` (so a row's first token is its window start)."""

    num_tokens: int
    seq_len: int
    batch_size: int
    seed: int


@st.composite
def loader_case_strategy(draw, *, max_tokens: int = 400) -> LoaderCase:
    """A token count, seq_len, and a global batch that divides over 1, 2 and 4 ranks."""
    seq_len = draw(st.integers(1, 12))
    num_windows = draw(st.integers(4, max(4, max_tokens // seq_len)))
    num_tokens = num_windows * seq_len + 1 + draw(st.integers(0, seq_len - 1))  # a ragged tail is never served
    batch_size = 4 * draw(st.integers(1, num_windows // 4))
    return LoaderCase(num_tokens, seq_len, batch_size, draw(st.integers(0, 2**40)))
