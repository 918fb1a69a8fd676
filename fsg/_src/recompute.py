"""Activation checkpointing in a traced step: module code that runs again in the backward reads
the step's parameters.

``torch.utils.checkpoint`` (Hugging Face's ``gradient_checkpointing_enable()`` too) runs the
checkpointed forward a second time while the backward is computed. ``fsg.apply`` used to swap
the step's tensors into the module for the call only (``torch.func.functional_call``), so that
second run read the module's own parameters: the values it was built with, which a compiled
step holds as constants. Every step then took its gradients at the initial weights, silently
(found 2026-12-04; ``tests/test_recompute.py``). While a step is traced (``scope``),
``fsg.apply`` keeps its swap open until the backward is traced too (``enter``). A module that
``fsg.apply`` gave two different parameter sets in one step (the same module object as student
and teacher, say) and that runs again in the backward is refused (``backward``): its second run
could not know which set it belongs to.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
from torch import nn

from fsg._src import _torch_private
from fsg._src.errors import UnsupportedError


class _Scope:
    def __init__(self, exits: contextlib.ExitStack):
        self.exits = exits
        self.given: dict[int, set[tuple]] = {}  # id(module) -> the parameter sets fsg.apply gave it


_OPEN: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("fsg_recompute", default=None)


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """While a step's loss and backward are traced: the swaps ``enter`` makes stay until exit."""
    with contextlib.ExitStack() as exits:
        token = _OPEN.set(_Scope(exits))
        try:
            yield
        finally:
            _OPEN.reset(token)


def enter(model: nn.Module, tensors: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> bool:
    """Within a ``scope``: ``tensors`` are ``model``'s parameters and buffers until the scope
    ends (``given``: the params as the caller passed them, which name the set); ``False``
    outside one, where the caller swaps them in for its call only."""
    open_scope = _OPEN.get()
    if open_scope is None:
        return False
    signature = tuple(sorted((name, id(t)) for name, t in given.items()))
    for module in model.modules():
        open_scope.given.setdefault(id(module), set()).add(signature)
    open_scope.exits.enter_context(_torch_private.reparametrize(model, tensors, tie_weights=True, strict=False))
    return True


@contextlib.contextmanager
def backward() -> Iterator[None]:
    """Within (a traced backward): module code that runs again (activation checkpointing) is
    refused where ``fsg.apply`` gave that module two different parameter sets in the step."""
    open_scope = _OPEN.get()

    def check(module: nn.Module, args: Any) -> None:
        if open_scope is not None and len(open_scope.given.get(id(module), ())) > 1:
            raise UnsupportedError(
                f"{type(module).__name__} runs again in the backward (activation checkpointing: "
                f"torch.utils.checkpoint) after fsg.apply gave it {len(open_scope.given[id(module)])} "
                f"different parameter sets in this step, so its second run cannot know which set to "
                f"read. Give each parameter set its own module (copy.deepcopy(model)), or do not "
                f"checkpoint that module."
            )

    handle = nn.modules.module.register_module_forward_pre_hook(check)
    try:
        yield
    except RuntimeError as exc:  # torch's reentrant checkpoint cannot run under torch.autograd.grad
        if "use_reentrant=True" not in str(exc):
            raise
        raise UnsupportedError(
            "a module is checkpointed with torch.utils.checkpoint(..., use_reentrant=True), which torch "
            "cannot differentiate the way a traced step does (torch.autograd.grad). Checkpoint with "
            "use_reentrant=False (a Hugging Face model: model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False}), its default)."
        ) from exc
    finally:
        handle.remove()
