"""Hyperparameter checks of the optimizers and schedules: a bad value raises ``ArgumentError``
when the optimizer is built, naming the builder and the argument, not deep inside a trace."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fsg._src import checks, tree
from fsg._src.errors import ArgumentError


def beta(where: str, value: Any) -> float:
    """A moment decay rate: in [0, 1)."""
    return checks.real(where, value, low=0.0, high=1.0, high_open=True, fix="Betas are decay rates such as 0.9 or 0.999")


def eps(where: str, value: Any) -> float:
    return checks.real(where, value, low=0.0, low_open=True, fix="It keeps the division finite; the usual value is 1e-8")


def non_negative(where: str, value: Any, fix: str = "") -> float:
    return checks.real(where, value, low=0.0, fix=fix)


def schedule(where: str, fn: Callable[[torch.Tensor], Any]) -> None:
    """Calls the schedule ``fn`` once on a count tensor: it must return a 0-d real tensor made
    with torch ops (it is traced into the step). Catches a schedule builder passed uncalled
    (``fsg.optim.cosine`` for ``fsg.optim.cosine(3e-4, 10_000)``) and Python-number results."""
    count = torch.zeros((), dtype=torch.int32)
    try:
        out = fn(count)
    except Exception as exc:  # noqa: BLE001 - reported with the fix
        raise ArgumentError(
            f"{where} is a function, so it is used as a schedule, but calling it with a step count "
            f"(a 0-d int32 tensor) raised {type(exc).__name__}: {exc}. A schedule maps the count to a "
            f"value, e.g. fsg.optim.cosine(3e-4, 10_000): call a schedule builder, do not pass it"
        ) from exc
    if not isinstance(out, torch.Tensor) or out.dim() != 0 or out.is_complex() or out.dtype == torch.bool:
        got = f"a {out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else checks._show(out)
        raise ArgumentError(
            f"{where} is a schedule, and a schedule must return a 0-d real tensor computed from the count "
            f"with torch ops (it is traced into the step, so Python numbers would be frozen); it returned "
            f"{got}. Use torch ops on the count (torch.where, torch.cos), or pass a float for a constant"
        )


def learning_rate(where: str, value: Any) -> None:
    """A learning rate: a float >= 0 or a schedule."""
    if callable(value):
        schedule(where, value)
    else:
        non_negative(where, value, fix="Pass a float such as 3e-4 or a schedule; the update already descends")


def like_params(where: str, what: str, value: Any, params: Any, fix: str) -> list[Any]:
    """``value``'s leaves, if it has the params' tree structure; else an ``ArgumentError``
    naming the missing and unexpected leaves (``what``: what ``value`` must be)."""
    leaves, value_def = tree.flatten(value)
    params_def = tree.flatten(params)[1]
    if value_def != params_def:
        want, have = tree.leaf_paths(params, "params"), tree.leaf_paths(value, "params")
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        detail = f"missing {missing[:5]}, unexpected {extra[:5]}" if missing or extra else f"{value_def} vs {params_def}"
        raise ArgumentError(f"{where}: {what} shaped like the params ({detail}). {fix}")
    return leaves


def mask(where: str, flags: Any, params: Any) -> None:
    """A weight-decay mask must have the params' tree structure, with bool leaves."""
    flag_leaves = like_params(where, "the mask must be a tree of bools", flags, params,
                              "Give one bool per parameter, or a function of the params, e.g. "
                              "lambda p: {k: v.ndim >= 2 for k, v in p.items()}")  # fmt: skip
    for path, flag in zip(tree.leaf_paths(params, "mask"), flag_leaves):
        if not (isinstance(flag, bool) or isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0):
            raise checks.fail(f"{where}: {path}", "must be a bool (decay this parameter or not)", flag)
