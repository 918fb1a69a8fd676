"""Decompositions fsg traces with everywhere: corrections of torch's own, and ops made to
declare their writes.

torch's decomposition tables are used by ``torch.compile`` (AOTAutograd, Inductor) and by
stage 1 on a mesh. Where one of them computes something other than its op, a compiled step
would train silently wrong; fsg traces the op with a correct decomposition instead, so
neither stage 2 nor Inductor ever sees it. Each entry names the torch issue and is tested
against the eager op (``tests/test_decompositions.py``).

``native_batch_norm`` and ``cudnn_batch_norm`` write the running statistics in place, but
their schemas do not say so (``Tensor? running_mean``, not ``Tensor(a!)?``), so neither the
graph facts nor torch's functionalization would see the write. ``DECLARED_WRITES`` traces them
as ``_native_batch_norm_legit`` (and its variants), the same computation with the writes in
its schema, which is what torch's own Python kernel does for AOTAutograd (see
``native_batch_norm_decomposition`` in ``torch/_decomp/decompositions.py``, whose comment calls
the old schema a TODO). The backward is ``native_batch_norm_backward`` on either device.

``von_mises_rejection`` replaces a Python function rather than an op: ``VonMises.sample``'s
rejection loop, which draws until every value is accepted and so cannot be traced.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

_aten = torch.ops.aten


def multilabel_margin_loss_forward(x: torch.Tensor, target: torch.Tensor, reduction: int) -> tuple:
    """``F.multilabel_margin_loss``'s forward: each row's target classes are the entries of
    ``target`` before its first negative one. torch's decomposition (through 2.13, pytorch
    issue 141017) lets the slots after that ``-1`` count too, as class 0: losses 2.4x too
    large on a row with fewer labels than classes, under ``torch.compile`` and on a mesh."""
    rows, labels = (x, target) if x.dim() == 2 else (x.reshape(1, -1), target.reshape(1, -1))
    classes = rows.shape[-1]
    slot = torch.arange(classes, device=labels.device)
    end = torch.where(labels < 0, slot, classes).amin(-1, keepdim=True)
    valid = slot < end  # [B, slots]: the slots before the first negative label
    safe = torch.where(valid, labels, 0)
    is_target = ((safe.unsqueeze(-1) == slot) & valid.unsqueeze(-1)).any(1)  # [B, classes]
    margins = (1 - rows.gather(-1, safe).unsqueeze(-1) + rows.unsqueeze(1)).clamp_min(0)  # [B, slot, class]
    keep = valid.unsqueeze(-1) & ~is_target.unsqueeze(1)
    loss = torch.where(keep, margins, 0).sum((1, 2)) / classes
    if reduction == 1:  # mean
        loss = loss.mean()
    elif reduction == 2:  # sum
        loss = loss.sum()
    elif x.dim() < 2:
        loss = loss.reshape(())
    return loss, is_target.to(x.dtype).reshape(target.shape)


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.take(index)``: ``x`` flattened, indexed by ``index`` (negative entries from the end).
    torch's decomposition (through 2.13) writes it as ``flattened[index]``, which Python reads
    as an integer index where ``index`` is 0-d: a host read of its value, so Inductor failed on
    the step (``GuardOnDataDependentSymNode``; OpInfo's 0-d ``put`` sample, whose backward
    takes). ``aten.index`` takes a 0-d index tensor as a tensor."""
    return _aten.index.Tensor(x.reshape(-1), [index])


CORRECTIONS: dict[Any, Callable[..., Any]] = {
    _aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
    _aten.take.default: take,
}


def native_batch_norm(x, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float):
    """``native_batch_norm`` as the op that declares its writes to the running statistics."""
    if running_mean is None and running_var is None:
        return _aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)
    if training:
        return _aten._native_batch_norm_legit.default(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
    return _aten._native_batch_norm_legit_no_training.default(x, weight, bias, running_mean, running_var, momentum, eps)


def cudnn_batch_norm(x, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float):
    """``cudnn_batch_norm`` (what ``F.batch_norm`` picks on CUDA) as ``native_batch_norm``, with
    the empty reserve its backward (below) ignores."""
    out, mean, invstd = native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)
    reserve = x.new_zeros((0,), dtype=torch.uint8)
    if training:
        return out, mean, invstd, reserve
    return out, weight.new_zeros((0,)), weight.new_zeros((0,)), reserve


def cudnn_batch_norm_backward(x, grad, weight, running_mean, running_var, save_mean, save_invstd, eps: float, reserve):
    """The backward of ``cudnn_batch_norm`` above: ``native_batch_norm_backward`` on the saved
    mean and inverse standard deviation (as torch's decomposition of it)."""
    return _aten.native_batch_norm_backward.default(
        grad, x, weight, running_mean, running_var, save_mean, save_invstd, True, eps, [True, True, True]
    )


DECLARED_WRITES: dict[Any, Callable[..., Any]] = {
    _aten.native_batch_norm.default: native_batch_norm,
    _aten.cudnn_batch_norm.default: cudnn_batch_norm,
    _aten.cudnn_batch_norm_backward.default: cudnn_batch_norm_backward,
}


VON_MISES_CANDIDATES = 32  # each accepted with probability >= 0.65: all fail with probability < 1e-14


def von_mises_rejection(loc: torch.Tensor, concentration: torch.Tensor, proposal_r: torch.Tensor, x: torch.Tensor):
    """``torch.distributions.von_mises._rejection_sample`` (Best and Fisher, 1979) over
    ``VON_MISES_CANDIDATES`` candidates per element, the first accepted taken (the last if none
    is), instead of drawing until all are accepted: a static graph's ``VonMises.sample``. Its
    candidates come from ``torch.rand``, so in a step from the step's key."""
    u1, u2, u3 = torch.rand((3, VON_MISES_CANDIDATES, *x.shape), dtype=loc.dtype, device=loc.device).unbind()
    z = torch.cos(math.pi * u1)
    f = (1 + proposal_r * z) / (proposal_r + z)
    c = concentration * (proposal_r - f)
    accept = ((c * (2 - c) - u2) > 0) | ((c / u2).log() + 1 - c >= 0)
    accept[-1] = True
    first = torch.argmax(accept.to(torch.int8), dim=0, keepdim=True)
    angle = torch.gather((u3 - 0.5).sign() * f.acos(), 0, first).squeeze(0)
    return (angle + math.pi + loc) % (2 * math.pi) - math.pi
