"""Argument checks shared by the public entry points: each raises ``ArgumentError`` naming the
function and argument, stating the rule, showing the value and suggesting the fix.

The foundation layer, so the libraries (optim, checkpoint) and the runtime use the same words.
What is checked, entry point by entry point, is listed in docs/compiling.md#errors.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from fsg._src.errors import ArgumentError


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def fail(where: str, rule: str, value: Any, fix: str = "") -> ArgumentError:
    """The error for argument ``where`` (``"adamw(eps=...)"``) breaking ``rule``."""
    return ArgumentError(f"{where} {rule}; got {_show(value)}{'. ' + fix if fix else ''}")


def real(where: str, value: Any, *, low: float | None = None, high: float | None = None,
         low_open: bool = False, high_open: bool = False, fix: str = "") -> float:  # fmt: skip
    """``value`` as a float if it is a finite real number in the given range."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        if low is None and high is None:
            rule = "must be a finite real number"
        elif high is None:
            rule = f"must be a finite number {'>' if low_open else '>='} {low}"
        elif low is None:
            rule = f"must be a finite number {'<' if high_open else '<='} {high}"
        else:
            rule = f"must be a number in {lo}, {hi}"
        raise fail(where, rule, value, fix)
    return float(value)


def integer(where: str, value: Any, *, low: int | None = None, fix: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``low``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or (low is not None and value < low):
        rule = "must be an int" + ("" if low is None else f" >= {low}")
        raise fail(where, rule, value, fix)
    return int(value)


def flag(where: str, value: Any, *, optional: bool = False) -> None:
    """Raises unless ``value`` is a bool (or ``None`` when ``optional``)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise fail(where, "must be True or False" + (" or None" if optional else ""), value)


def instance(where: str, value: Any, kind: type | tuple[type, ...], *, what: str, fix: str = "") -> None:
    """Raises unless ``value`` is a ``kind`` (``what`` names it for the message)."""
    if not isinstance(value, kind):
        raise fail(where, f"must be {what}", value, fix)


def function(where: str, value: Any, *, fix: str = "") -> None:
    """Raises unless ``value`` is callable."""
    if not callable(value):
        raise fail(where, "must be callable", value, fix)
