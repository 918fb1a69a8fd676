"""Using an ``nn.Module`` as a pure function of its parameters.

``apply`` runs a module's ``forward`` on given parameters. It checks the names it is given
against the module's, runs the module in eval mode where an evaluation step asks for it
(``training``), and turns a module that cannot be traced (it needs a tensor's value on the
host) into an ``fsg.HostSyncError`` naming the submodule and the user's line.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import traceback
from typing import Any, Iterator

import torch
from torch import nn

from fsg._src import _torch_private, frozen, recompute, watch
from fsg._src.errors import FsgError, HostSyncError, StructureMismatchError, UnsupportedError

# The mode ``apply`` runs modules in: None leaves each module's own ``training`` flag.
_TRAINING: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fsg_training", default=None)
_TORCH_DIR = os.path.dirname(torch.__file__)
_FSG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a fake tensor (a traced step's stand-in for data) raises when code asks for its data.
_NO_DATA = (".numpy()", "data pointer", "tensor subclass")
# what to do where an op's meta function refuses inputs its eager kernel takes (torch's gaps;
# tests/models/test_hf_moe.py)
_META_FIXES = {
    "aten._grouped_mm": "Its meta function takes bfloat16 operands only, though its CPU kernel runs float32 "
    "eagerly: train in bfloat16 (precision=fsg.Policy(compute=torch.bfloat16)), or, for a Hugging Face "
    "mixture of experts, pick an implementation of plain batched matmuls: "
    "model.set_experts_implementation('batched_mm').",
}


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Returns the parameters of ``model`` as a flat dict of detached tensors.

    Tied weights (one ``nn.Parameter`` reachable under several names) are stored once, under
    the first name ``named_parameters()`` yields; ``apply`` re-ties them. Frozen parameters
    (``requires_grad=False``) are included; a compiled step does not train them.

    Args:
      model: any ``nn.Module``.

    Returns:
      ``{name: tensor}``; the tensors share storage with the module's parameters.

    Example:
      >>> p = fsg.params(torch.nn.Linear(2, 3))
      >>> sorted(p)
      ['bias', 'weight']
    """
    return {name: p.detach() for name, p in model.named_parameters()}


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Returns the buffers of ``model`` (e.g. BatchNorm running statistics) as detached tensors.

    Example:
      >>> sorted(fsg.buffers(torch.nn.BatchNorm1d(4)))
      ['num_batches_tracked', 'running_mean', 'running_var']
    """
    return {name: b.detach() for name, b in model.named_buffers()}


@contextlib.contextmanager
def training(mode: bool | None) -> Iterator[None]:
    """Inside, ``apply`` runs every module with ``module.training = mode`` (restored after
    each call); ``None`` keeps each module's own flag. An evaluation step traces its function
    under ``training(False)``: dropout off, BatchNorm on its running statistics."""
    token = _TRAINING.set(mode)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def apply(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    *args: Any,
    buffers: dict[str, torch.Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """Calls ``model(*args, **kwargs)`` with ``params`` (and ``buffers``) in place of its own.

    The module is only a template: its own parameter values are never read, so ``params``
    must name every parameter (a tied weight once, under either name) and nothing else.
    Buffers default to the module's own, which a compiled step then holds as constants.
    Inside a step compiled by ``fsg.compile_eval`` the module runs in eval mode (dropout off,
    BatchNorm on its running statistics); elsewhere in the mode it is in.

    Args:
      model: the module whose ``forward`` to run.
      params: ``{name: tensor}`` as returned by ``fsg.params``.
      *args: positional arguments of ``forward``.
      buffers: optional ``{name: tensor}`` replacing the module's buffers.
      **kwargs: keyword arguments of ``forward``.

    Returns:
      Whatever ``forward`` returns.

    Raises:
      StructureMismatchError: ``params`` lacks a parameter of ``model``, or ``params`` /
        ``buffers`` name a tensor ``model`` does not have.
      HostSyncError: while a step is traced, a submodule needs a tensor's value on the host
        (``.item()``, ``if tensor:``, ``.numpy()``); the message names the submodule's path
        and class, and the line.

    Example:
      >>> lin = torch.nn.Linear(2, 3)
      >>> fsg.apply(lin, fsg.params(lin), torch.ones(4, 2)).shape
      torch.Size([4, 3])
    """
    _check_names(model, params, buffers)
    watch.note(model)  # while a step is traced: its modes and requires_grad flags are part of its key
    given, params = params, frozen.detach(model, params)  # while a step is traced: no gradient to a frozen one
    params = _with_grad_hooks(model, params)
    tensors = dict(params) if not buffers else {**params, **buffers}
    with _mode(model, _TRAINING.get()):
        try:
            if recompute.enter(model, tensors, given):  # a step's trace: swapped in through its backward
                return model(*args, **kwargs)
            return torch.func.functional_call(model, tensors, args, kwargs, tie_weights=True, strict=False)
        except Exception as exc:
            fake = any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors.values())
            located = _located(exc, model, fake)
            if located is None:
                raise
            raise located from exc


def _with_grad_hooks(model: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with the gradient hooks of ``model``'s own parameters (``p.register_hook``,
    e.g. a mask on an embedding's gradient) on views of them, so a backward runs them as
    eager's does; a post-accumulate-grad hook (an optimizer stepping in backward) raises."""
    hooked, seen = dict(params), set()
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied weight: under the name given
        if id(p) in seen or name not in params:
            continue
        seen.add(id(p))
        hooks, post_accumulate = _torch_private.grad_hooks(p)
        if post_accumulate:
            raise UnsupportedError(
                f"fsg.apply: parameter {name!r} of {type(model).__name__} has a post-accumulate-grad hook "
                f"(register_post_accumulate_grad_hook, e.g. an optimizer stepping in the backward); a compiled "
                f"step applies its own optimizer to the whole gradient. Remove the hook."
            )
        if hooks and params[name].requires_grad:
            hooked[name] = params[name].view_as(params[name])  # a view: the caller's tensor gets no hook
            for hook in hooks:
                hooked[name].register_hook(hook)
    return hooked


@contextlib.contextmanager
def _mode(model: nn.Module, mode: bool | None) -> Iterator[None]:
    if mode is None:
        yield
        return
    before = [(m, m.training) for m in model.modules()]
    model.train(mode)
    try:
        yield
    finally:
        for m, flag in before:
            m.training = flag


def _check_names(model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None) -> None:
    """Every parameter of ``model`` given once (any name of a tied weight), no unknown names."""
    names: dict[int, list[str]] = {}  # one entry per parameter object, all its names
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    kind = type(model).__name__
    missing = [aliases[0] for aliases in names.values() if not any(n in params for n in aliases)]
    if missing:
        raise StructureMismatchError(
            f"fsg.apply: params has no entry for {len(missing)} parameter(s) of the {kind}: "
            f"{_listed(missing)}. fsg.apply never reads a module's own parameters; pass every one "
            f"(fsg.params(model) gives them all). To keep one fixed, pass it anyway and leave it "
            f"out of the update (e.g. zero its learning rate), or make it a buffer."
        )
    known = {n for aliases in names.values() for n in aliases}
    buffer_names = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    for what, given, allowed in (("params", params, known | buffer_names), ("buffers", buffers or {}, buffer_names)):
        unknown = sorted(set(given) - allowed)
        if unknown:
            valid = sorted(allowed)
            raise StructureMismatchError(
                f"fsg.apply: {what} names {_listed(unknown)}, which the {kind} does not have (its "
                f"{what}: {_listed(valid)}). Build {what} with fsg.{what}(model) and keep its keys."
            )


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _located(exc: Exception, model: nn.Module, fake: bool) -> FsgError | None:
    """The error to raise for ``exc`` escaping ``model``'s forward, or None to let it pass.

    A data-dependent guard, or a stand-in tensor (``fake``: the params are not plain
    tensors, as while a step is traced) asked for its data, becomes a ``HostSyncError``;
    an fsg error raised by an op (a random op it cannot key, say) gets the submodule's path.
    """
    frames = list(traceback.walk_tb(exc.__traceback__))
    where = _module_path(frames, model)
    line = _user_line(frames)
    guard = isinstance(exc, _torch_private.DATA_DEPENDENT_ERRORS)
    if guard or (fake and type(exc) is RuntimeError and any(s in str(exc) for s in _NO_DATA)):
        what = "data-dependent Python control flow" if guard else "its data, e.g. .numpy()"
        return HostSyncError(
            f"{where} needs the value of a tensor on the host ({what}) at {line}: a compiled step is "
            f"traced once on stand-ins without data and replayed, so a value known only at run time "
            f"cannot steer Python. Write it with tensor ops (torch.where(cond, a, b) for a branch; "
            f"0-d tensors, not .item() or float(); torch ops, not numpy)."
        )
    op = _refusing_op(frames) if fake and type(exc) is RuntimeError else None
    if op in _META_FIXES:  # (elsewhere the meta function's error is the kernel's too: a shape bug, say)
        return UnsupportedError(
            f"{where} calls {op} at {line} on inputs its meta function refuses (a step is traced on "
            f"stand-ins, so torch runs the op's meta function, not its kernel): {str(exc).strip()} {_META_FIXES[op]}"
        )
    # An fsg error raised inside, or carried as an exception's argument (stage 1's purity
    # diagnosis stops a re-run of the loss that way): say which submodule it came from.
    for error in (exc, *exc.args):
        if isinstance(error, FsgError) and error.args and isinstance(error.args[0], str):
            if " (in module " not in error.args[0]:
                error.args = (f"{error.args[0]} (in module {where})", *error.args[1:])
            break
    return None


def _refusing_op(frames: list) -> str | None:
    """``'aten._grouped_mm'``: the op whose fake (meta) dispatch raised, innermost first, or
    None where the error came from elsewhere."""
    for frame, _ in reversed(frames):
        func, code = frame.f_locals.get("func"), frame.f_code
        in_fake_dispatch = "fake_tensor" in code.co_filename or "meta" in code.co_name
        if isinstance(func, _torch_private.OpOverload) and code.co_filename.startswith(_TORCH_DIR) and in_fake_dispatch:
            return _torch_private.op_name(func)
    return None


def _module_path(frames: list, model: nn.Module) -> str:
    """``'layer2.0.conv1' (Conv2d) of the ResNet``: the innermost submodule whose code was running."""
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    found = None
    for frame, _ in frames:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names and isinstance(owner, nn.Module):
            found = owner
    root = type(model).__name__
    if found is None or found is model:
        return f"the {root} given to fsg.apply"
    return f"{names[id(found)]!r} ({type(found).__name__}) of the {root} given to fsg.apply"


def _user_line(frames: list) -> str:
    """The innermost frame of user code (not torch, not fsg): file, line and source."""
    for frame, lineno in reversed(frames):
        filename = frame.f_code.co_filename
        if not (filename.startswith((_TORCH_DIR, _FSG_DIR)) or filename.startswith("<")):
            code = traceback.FrameSummary(filename, lineno, frame.f_code.co_name).line or ""
            return f'File "{filename}", line {lineno}: {code.strip()}'
    return "(source line unknown)"
