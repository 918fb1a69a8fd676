"""The module flags a traced step depends on, checked again at every call.

A step is traced once, and ``fsg.apply`` reads two kinds of flags from the user's modules
while it is: each module's ``training`` (dropout on or off, BatchNorm on batch or running
statistics) and each parameter's ``requires_grad`` (``frozen.py``: a frozen parameter is not
trained). Eager PyTorch reads both at every call, and so does ``torch.compile`` (its guards).
So a ``Step`` records, while it traces, every module ``fsg.apply`` ran (``recording``), and
keys its compiled graphs by the flags of those modules as well as by the abstract signature
(``Flags.now``): after ``model.eval()`` or ``model.train()``, or a parameter frozen or
unfrozen, the next call traces the step again (with a ``RecompileWarning``, or a
``RecompileError`` under ``strict=True``), and switching back reuses the graph already built.

The check costs one attribute read per submodule and per parameter of the recorded modules
(lists built once, at the trace); benchmarks/step_overhead.py times it.
The step holds the recorded modules (as its loss function does, which runs them).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Iterator

from torch import nn

_TRAINING, _REQUIRES_GRAD = operator.attrgetter("training"), operator.attrgetter("requires_grad")
_RECORDING: contextvars.ContextVar[Flags | None] = contextvars.ContextVar("fsg_watch", default=None)


class _Watched:
    """One module ``fsg.apply`` ran while a step was traced: its submodules and parameters."""

    def __init__(self, model: nn.Module):
        root = type(model).__name__
        named = list(model.named_modules(remove_duplicate=False))
        self.modules = [m for _, m in named]
        self.module_names = [f"{root}.{n}" if n else root for n, _ in named]
        params = list(model.named_parameters(remove_duplicate=False))
        self.params = [p for _, p in params]
        self.param_names = [f"{root}.{n}" for n, _ in params]

    def now(self) -> tuple[bool, ...]:
        return (*map(_TRAINING, self.modules), *map(_REQUIRES_GRAD, self.params))

    def names(self) -> list[str]:
        return [f"{n}.training" for n in self.module_names] + [f"{n}.requires_grad" for n in self.param_names]


class Flags:
    """The modules one step's traces ran, and their flags now (part of the step's cache key)."""

    def __init__(self) -> None:
        self._watched: list[_Watched] = []
        self._ids: set[int] = set()

    def note(self, model: nn.Module) -> None:
        if id(model) not in self._ids:
            self._ids.add(id(model))
            self._watched.append(_Watched(model))

    def now(self) -> tuple[tuple[bool, ...], ...]:
        """The flags of every recorded module, now."""
        return tuple(w.now() for w in self._watched)

    def describe(self, old: tuple[tuple[bool, ...], ...], new: tuple[tuple[bool, ...], ...]) -> str:
        """Names the flags that differ between two ``now()`` results (a module recorded since
        ``old`` was taken counts as unchanged)."""
        changes = []
        for w, a, b in zip(self._watched, old, new):
            if a != b:
                changes += [f"{n}: {x} -> {y}" for n, x, y in zip(w.names(), a, b) if x != y]
        shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        return shown or "a module's train/eval mode or a parameter's requires_grad"


@contextlib.contextmanager
def recording(flags: Flags) -> Iterator[None]:
    """Within (a step's trace), ``note`` adds each module ``fsg.apply`` runs to ``flags``."""
    token = _RECORDING.set(flags)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def note(model: nn.Module) -> None:
    """Called by ``fsg.apply``: records ``model`` while a step is traced; nothing otherwise."""
    flags = _RECORDING.get()
    if flags is not None:
        flags.note(model)
