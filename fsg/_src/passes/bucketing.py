"""Cutting a sequence of collectives into buckets: shared by the gradient buckets
(``buckets.py``) and the parameter gathers (``prefetch.py``).

A bucket is a run of consecutive items (the caller has put them in the order it wants them
issued) that may become one collective (``packing.pack``): the same collective, input dtype
and device, and the same arguments after the input (reduce op, group size, process group),
at most ``budget`` bytes together. An item alone over the budget gets a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from torch import fx

from fsg._src.passes.moves import meta_value

DEFAULT_BUCKET_MB = 25.0
T = TypeVar("T")


def key(collective: fx.Node) -> tuple:
    """What two collectives must share to be packed into one (``collective``'s input has a
    fake value): its target, its input's dtype and device, and its arguments after the input."""
    value = meta_value(collective.args[0])
    return (collective.target, value.dtype, value.device, *collective.args[1:])


def buckets(
    items: Sequence[T],
    budget: float,
    *,
    key: Callable[[T], Hashable],
    nbytes: Callable[[T], int],
    joins: Callable[[list[T], T], bool] | None = None,
) -> list[list[T]]:
    """``items``, in their order, cut into buckets of consecutive items with one ``key`` and at
    most ``budget`` bytes (``nbytes`` each); ``joins(bucket, item)`` may refuse an item that
    fits (one that depends on a result of the bucket), which then starts the next bucket.

    >>> buckets([1, 3, 2, 4, 5, 7], 6, key=lambda n: n % 2, nbytes=lambda n: n)
    [[1, 3], [2, 4], [5], [7]]
    >>> buckets([1, 1, 2, 3], 9, key=lambda n: 0, nbytes=lambda n: n, joins=lambda b, n: n != 2)
    [[1, 1], [2, 3]]
    """
    out: list[list[T]] = []
    for item in items:
        current = out[-1] if out else None
        fits = (
            current is not None
            and key(current[0]) == key(item)
            and sum(nbytes(i) for i in current) + nbytes(item) <= budget
            and (joins is None or joins(current, item))
        )
        if fits:
            current.append(item)
        else:
            out.append([item])
    return out
