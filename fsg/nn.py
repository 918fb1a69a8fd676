"""Functional layers and losses."""

from fsg._src.losses import cross_entropy as cross_entropy

__all__ = ["cross_entropy"]
