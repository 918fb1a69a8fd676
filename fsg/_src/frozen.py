"""Frozen parameters: a module parameter with ``requires_grad=False`` is not trained.

``fsg.params(model)`` returns every parameter, frozen or not, so a step's state holds them all
(checkpoints, sharding, devices). While ``compile_step`` traces a step, ``fsg.apply`` reads each
module parameter's ``requires_grad`` (``detach``): where the module reads a frozen one, its
tensor is detached, so no gradient flows to it, and the tracer records its leaf (``tracking``).
The step then returns those leaves as they came in, with their optimizer state (``keep``):
bit for bit, whatever the optimizer (weight decay included), as ``torch.optim`` skips a
parameter without a gradient. So it does for a parameter the loss does not reach at all (an
unused head, a pooler): no gradient, so no update, as in eager PyTorch (where optax would
still decay it). Examples in the wild: the sinusoidal position tables of Whisper,
Pegasus or Marian, a backbone frozen for fine-tuning, LoRA's base weights.

The flags are read when the step is traced, and checked at every call (``watch.py``): after
``requires_grad_()`` the step is traced again. A parameter the loss reaches other than through ``fsg.apply`` (or through a
tensor it computed from the params it was given) is trained, as any leaf of the state.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any, Iterator

import torch
from torch import nn

from fsg._src import tree

log = logging.getLogger("fsg")

# while a step is traced: ({id(tensor the loss reads for leaf i): i}, the frozen leaves found)
_TRACKING: contextvars.ContextVar[tuple[dict[int, int], set[int]] | None] = contextvars.ContextVar(
    "fsg_frozen", default=None
)


@contextlib.contextmanager
def tracking(reads: list[torch.Tensor]) -> Iterator[set[int]]:
    """Within, ``detach`` records the index in ``reads`` (the tensors the loss is given for the
    state's param leaves, in order) of each frozen parameter ``fsg.apply`` is given."""
    found: set[int] = set()
    token = _TRACKING.set(({id(t): i for i, t in enumerate(reads)}, found))
    try:
        yield found
    finally:
        _TRACKING.reset(token)


def detach(model: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with the tensors of ``model``'s frozen parameters detached, while a step is
    traced (``tracking``); ``params`` itself otherwise."""
    tracker = _TRACKING.get()
    if tracker is None:
        return params
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if not frozen & params.keys():
        return params
    leaves, found = tracker
    out = dict(params)
    for name in frozen & params.keys():
        if id(params[name]) in leaves:
            found.add(leaves[id(params[name])])
        out[name] = params[name].detach()
    return out


def keep(
    new: tuple[Any, Any], old: tuple[Any, Any], params_def: Any, frozen: set[int], kept: set[int]
) -> tuple[Any, Any]:
    """``(params, opt_state)`` with the ``kept`` param leaves (the ``frozen`` ones, and those the
    loss does not reach), and their leaves in each subtree of the optimizer state shaped like
    the params (Adam's moments, say), taken from ``old``: torch.optim skips a parameter whose
    ``.grad`` is ``None``, so neither its update nor its weight decay applies."""
    if not kept:
        return new
    names = tree.leaf_paths(old[0], "params")
    for what, which in (("frozen parameter(s) (requires_grad=False)", frozen),
                        ("parameter(s) the loss does not reach", kept - frozen)):  # fmt: skip
        if which:
            shown = ", ".join(names[i] for i in sorted(which)[:8]) + (" ..." if len(which) > 8 else "")
            log.info("fsg: %d %s not trained: %s", len(which), what, shown)
    return kept_leaves(new, old, params_def, kept)


def kept_leaves(new: tuple[Any, Any], old: tuple[Any, Any], params_def: Any, kept: set[int]) -> tuple[Any, Any]:
    """``keep``'s result without its log line: the pipeline step calls it at every step."""
    if not kept:
        return new
    if params_def.num_nodes == 1:  # the params are one tensor: no subtree of the state is "like" it
        return old[0], new[1]
    return tuple(_keep_like(n, o, params_def, kept) for n, o in zip(new, old))


def _keep_like(new: Any, old: Any, params_def: Any, kept: set[int]) -> Any:
    leaves, treedef = tree.flatten_masked(new)  # a group's state in multi_transform: masked like the params
    if treedef == params_def:
        old_leaves, _ = tree.flatten_masked(old)
        return tree.unflatten(params_def, [o if i in kept else n for i, (n, o) in enumerate(zip(leaves, old_leaves))])
    if isinstance(new, dict):
        return type(new)((k, _keep_like(v, old[k], params_def, kept)) for k, v in new.items())
    if isinstance(new, tuple) and hasattr(new, "_fields"):  # a NamedTuple state
        return type(new)(*(_keep_like(n, o, params_def, kept) for n, o in zip(new, old)))
    if isinstance(new, (tuple, list)):
        return type(new)(_keep_like(n, o, params_def, kept) for n, o in zip(new, old))
    return new
