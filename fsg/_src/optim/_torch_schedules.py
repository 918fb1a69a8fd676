"""A ``torch.optim.lr_scheduler`` as fsg schedules: the learning rate of each parameter group
at optimizer step ``t`` (the value ``group["lr"]`` holds for the ``t``-th ``optimizer.step()``
of a loop that calls ``scheduler.step()`` after each), in closed form over the step tensor, so
it is traced into the graph like fsg's own schedules.

StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, ConstantLR, PolynomialLR,
OneCycleLR (without momentum cycling: fsg's momentum is a constant), a SequentialLR of them,
and the LambdaLRs of Hugging Face's ``get_{linear,cosine,constant,polynomial_decay}_schedule_with_warmup``.
Others are refused by name: another ``LambdaLR`` (its function is Python, usually with an
``if`` on the step), ``ReduceLROnPlateau`` (it reads the metric), the cyclic ones.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from fsg._src import _torch_private, checks
from fsg._src.optim._schedules import Schedule

_Closed = Callable[[torch.Tensor], torch.Tensor]  # float64 step -> float64 learning rate


def schedules_of(scheduler: Any, optimizer: torch.optim.Optimizer) -> list[Schedule]:
    """One fsg schedule per parameter group of ``optimizer`` for a fresh ``scheduler`` of it."""
    name = type(scheduler).__name__
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise checks.fail("fsg.optim.from_torch(scheduler=...)", "must be a scheduler of the optimizer given",
                          name, "Pass the scheduler built on this optimizer")  # fmt: skip
    if getattr(scheduler, "last_epoch", 0) != 0:
        raise checks.fail(f"fsg.optim.from_torch(scheduler={name})", "must not have been stepped yet (fsg counts "
                          "from step 0)", f"last_epoch={scheduler.last_epoch}", "Translate it before training")  # fmt: skip
    return [_as_schedule(_closed(scheduler, i)) for i in range(len(optimizer.param_groups))]


def _as_schedule(closed: _Closed) -> Schedule:
    def schedule(count: torch.Tensor | int) -> torch.Tensor:
        t = count if isinstance(count, torch.Tensor) else torch.tensor(count)
        return closed(t.to(torch.float64)).to(torch.float32)

    return schedule


def _closed(s: Any, i: int) -> _Closed:
    """Scheduler ``s``'s learning rate of group ``i`` as a function of the step."""
    name, base = type(s).__name__, s.base_lrs[i] if hasattr(s, "base_lrs") else None
    if name == "StepLR":
        return lambda t: base * s.gamma ** torch.floor(t / s.step_size)
    if name == "MultiStepLR":
        milestones = sorted(s.milestones.elements())  # a Counter: a milestone given twice decays twice
        return lambda t: base * s.gamma ** sum(((t >= m).double() for m in milestones), torch.zeros_like(t))
    if name == "ExponentialLR":
        return lambda t: base * s.gamma**t
    if name == "CosineAnnealingLR":
        return lambda t: s.eta_min + (base - s.eta_min) * (1 + torch.cos(math.pi * t / s.T_max)) / 2
    if name == "LinearLR":
        return lambda t: base * (s.start_factor + (s.end_factor - s.start_factor) * t.clamp(max=s.total_iters) / s.total_iters)
    if name == "ConstantLR":
        return lambda t: torch.where(t < s.total_iters, base * s.factor, base + 0 * t)
    if name == "PolynomialLR":
        return lambda t: base * (1 - t.clamp(max=s.total_iters) / s.total_iters) ** s.power
    if name == "OneCycleLR":
        return _one_cycle(s, i)
    if name == "SequentialLR":
        parts = _torch_private.lr_scheduler_parts(s)
        pieces = [_closed(sub, i) for sub in parts["schedulers"]]

        def sequential(t: torch.Tensor) -> torch.Tensor:
            value = pieces[0](t)
            for milestone, piece in zip(parts["milestones"], pieces[1:]):
                value = torch.where(t >= milestone, piece(t - milestone), value)
            return value

        return sequential
    if name == "LambdaLR" and _hugging_face_factor(s.lr_lambdas[i]) is not None:
        factor = _hugging_face_factor(s.lr_lambdas[i])
        return lambda t: base * factor(t)
    why = {"LambdaLR": "its function is Python code (often with an if on the step), not a tensor function "
                       "(Hugging Face's get_{linear,cosine,constant,polynomial_decay}_schedule_with_warmup are translated)",
           "MultiplicativeLR": "its function is Python code", "ReduceLROnPlateau": "it reads the metric each epoch",
           "ChainedScheduler": "it composes schedulers multiplicatively step by step"}.get(name, "fsg has no closed form of it")  # fmt: skip
    raise checks.fail(f"fsg.optim.from_torch(scheduler={name})", f"cannot be translated: {why}", name,
                      "Use an fsg schedule (fsg.optim.warmup_cosine, linear, cosine, piecewise; docs/optimizers.md)")  # fmt: skip


def _hugging_face_factor(fn: Any) -> _Closed | None:
    """The LambdaLR factor of one of transformers' warm-up schedules (a ``functools.partial`` of
    ``transformers.optimization``'s lambda, its arguments keywords) in tensor ops, or None."""
    inner, kw = getattr(fn, "func", None), getattr(fn, "keywords", None) or {}
    if not (getattr(inner, "__module__", "") or "").startswith("transformers") or getattr(fn, "args", ()):
        return None
    kind = getattr(inner, "__name__", "").removeprefix("_get_").removesuffix("_schedule_with_warmup_lr_lambda")
    w = kw.get("num_warmup_steps", 0)
    warm = lambda t: t / max(1, w)  # noqa: E731
    if kind == "linear":
        total = kw["num_training_steps"]
        after = lambda t: ((total - t) / max(1, total - w)).clamp(min=0)  # noqa: E731
    elif kind == "cosine":
        total, cycles, floor = kw["num_training_steps"], kw["num_cycles"], kw.get("min_lr_rate", 0.0)
        progress = lambda t: (t - w) / max(1, total - w)  # noqa: E731
        after = lambda t: (0.5 * (1 + torch.cos(math.pi * cycles * 2 * progress(t))) * (1 - floor) + floor).clamp(min=0)  # noqa: E731
    elif kind == "constant":
        after = torch.ones_like
    elif kind == "polynomial_decay":
        total, end, power, init = kw["num_training_steps"], kw["lr_end"], kw["power"], kw["lr_init"]
        decay = lambda t: ((init - end) * (1 - (t - w) / max(1, total - w)) ** power + end) / init  # noqa: E731
        after = lambda t: torch.where(t > total, end / init + 0 * t, decay(t))  # noqa: E731
    else:
        return None
    return lambda t: torch.where(t < w, warm(t), after(t))


def _one_cycle(s: Any, i: int) -> _Closed:
    if s.cycle_momentum:
        raise checks.fail("fsg.optim.from_torch(scheduler=OneCycleLR)", "cycles the momentum (cycle_momentum=True), "
                          "which fsg holds constant", True, "Build it with cycle_momentum=False")  # fmt: skip
    parts, group = _torch_private.lr_scheduler_parts(s), s.optimizer.param_groups[i]
    phases, total = parts["phases"], s.total_steps

    def anneal(start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if parts["anneal"] == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def one_cycle(t: torch.Tensor) -> torch.Tensor:
        t = t.clamp(max=total)  # torch raises past total_steps; fsg holds the last phase's end
        value, starts = None, [0.0] + [float(p["end_step"]) for p in phases[:-1]]
        for k in reversed(range(len(phases))):  # the first phase whose end t has not passed wins
            phase, start_step = phases[k], starts[k]
            pct = (t - start_step) / (float(phase["end_step"]) - start_step)
            lr = anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct)
            value = lr if value is None else torch.where(t <= float(phase["end_step"]), lr, value)
        return value

    return one_cycle
