"""Stage 1: a cross-entropy of a linear layer's logits, traced as ``linear_cross_entropy``.

A language model's loss is ``cross_entropy(linear(h, W).float().view(-1, V), targets)``:
the logits, the step's largest tensor, are written by one GEMM, read by the loss, their
gradient written and read again by the two backward GEMMs, and the loss's own kernels pass
over them several times. ``fsg.nn.linear_cross_entropy`` computes the same loss a chunk of
rows at a time, the logits turning into their gradient in the kernel that computes the loss
(``kernels/linear_cross_entropy.py``). Models written with ``nn.Linear`` and
``F.cross_entropy`` (every Hugging Face causal LM) get it without a change: while the step is
traced, ``FusedLoss`` follows each ``F.linear`` output through the ops that keep its last dim
the class dim, and traces a ``F.cross_entropy`` of one as ``linear_cross_entropy`` of the
linear's input instead. The linear is still traced; nothing reads it then, and it is dropped.

Followed: casts to float32 (``.float()``, ``.to(torch.float32)``), ``view`` / ``reshape`` /
``flatten`` that keep the last dim, ``contiguous``, and indexing that leaves the last dim
whole (``logits[:, :-1]``: the same index is applied to ``h``). Rewritten only where the
result is the same computation up to rounding of the GEMMs: the linear has no bias; the loss
has no class weights, no label smoothing, reduction ``"mean"`` or ``"sum"``, class-index
targets, ``[N, V]`` logits, and runs in float32 (the logits cast up, as Hugging Face's
losses do, float32 compute, or under CUDA autocast, which runs the loss in float32). The logits
are computed in the linear's own output dtype, as the linear computed them. Nothing is
rewritten once the logits, ``h`` or the weight (or a view of one) was written in place
between the linear and the loss (``logits[..., pad] = -inf``): their version counters say so.
Anything else is traced as written. ``compile_step(..., fused_loss=False)`` turns the rewrite off.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fsg._src import _torch_private
from fsg._src.kernels import linear_cross_entropy as lce


class _Logits(NamedTuple):
    """A tensor equal to ``F.linear(h, weight)`` (in float32 or the linear's dtype), as long as
    none of the three is written in place: their version counters then stay as recorded."""

    tensor: torch.Tensor  # the tensor followed (kept alive: ids are never reused meanwhile)
    h: torch.Tensor  # rows whose projection the tensor is, same leading shape
    weight: torch.Tensor
    dtype: torch.dtype  # the dtype the linear computed the logits in
    versions: tuple[int, ...] = ()

    def recorded(self) -> _Logits:
        return self._replace(versions=_versions(self))

    def intact(self) -> bool:
        """No in-place write to the tensor, ``h`` or ``weight`` (or a view of one) since."""
        return self.versions == _versions(self)


def _versions(logits: _Logits) -> tuple[int, ...]:
    return tuple(_torch_private.version(t) for t in (logits.tensor, logits.h, logits.weight))


_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten}
_CASTS = {torch.Tensor.float, torch.Tensor.to}


class FusedLoss(TorchFunctionMode):
    """Traces ``cross_entropy(<logits of F.linear(h, W)>, t)`` as ``linear_cross_entropy``."""

    def __init__(self) -> None:
        super().__init__()
        self._logits: dict[int, _Logits] = {}
        self.rewritten = 0  # how many losses were traced fused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            fused = self._fused(*args, **kwargs)
            if fused is not None:
                self.rewritten += 1
                return fused
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return out
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if bias is None and isinstance(weight, torch.Tensor) and weight.dim() == 2 and out.dim() >= 2:
                self._follow(out, _Logits(out, args[0], weight, out.dtype))
            return out
        src = self._logits.get(id(args[0]))
        if src is None or src.tensor is not args[0] or out.shape[-1:] != src.tensor.shape[-1:] or not src.intact():
            return out
        if func in _CASTS and out.dtype == torch.float32 and _is_cast(func, args, kwargs):
            self._follow(out, src._replace(tensor=out))
        elif (func is torch.Tensor.contiguous or func in _VIEWS) and out.dtype == args[0].dtype:
            h = src.h.reshape(*out.shape[:-1], src.h.shape[-1])
            self._follow(out, src._replace(tensor=out, h=h))
        elif func is torch.Tensor.__getitem__ and len(args) == 2 and _leaves_last_dim(args[1], args[0].dim()):
            self._follow(out, src._replace(tensor=out, h=src.h[args[1]]))
        return out

    def _follow(self, out: torch.Tensor, logits: _Logits) -> None:
        self._logits[id(out)] = logits.recorded()

    def _fused(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
               reduction="mean", label_smoothing=0.0):  # fmt: skip
        src = self._logits.get(id(input)) if isinstance(input, torch.Tensor) else None
        if src is None or src.tensor is not input or input.dim() != 2 or not src.intact():
            return None
        plain = weight is None and size_average is None and reduce is None and not label_smoothing
        # float32 logits, or CUDA's autocast, which runs the loss in float32
        in_float32 = input.dtype == torch.float32 or (input.is_cuda and torch.is_autocast_enabled("cuda"))
        is_index = isinstance(target, torch.Tensor) and target.dtype == torch.int64 and target.shape == input.shape[:1]
        if not (plain and in_float32 and is_index and reduction in ("mean", "sum")):
            return None
        with torch.autocast(input.device.type, enabled=False):  # the logits' dtype is the linear's
            h, w = src.h.reshape(-1, src.h.shape[-1]).to(src.dtype), src.weight.to(src.dtype)
            return _loss(h, w, target, ignore_index, reduction)


def _loss(h_ND, weight, targets_N, ignore_index: int, reduction: str) -> torch.Tensor:
    loss = lce.linear_cross_entropy(h_ND, weight, targets_N, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        return loss
    counted = (targets_N != ignore_index).any()  # every target ignored: torch's mean is 0/0
    return torch.where(counted, loss, torch.full_like(loss, math.nan))


def _is_cast(func, args: tuple, kwargs: dict) -> bool:
    """A pure dtype cast: ``x.float()``, ``x.to(dtype)`` or ``x.to(dtype=dtype)``."""
    if func is torch.Tensor.float:
        return len(args) == 1 and not kwargs
    dtype = args[1] if len(args) == 2 else kwargs.get("dtype") if len(args) == 1 else None
    return isinstance(dtype, torch.dtype) and set(kwargs) <= {"dtype", "non_blocking", "copy"}


def _leaves_last_dim(key: Any, ndim: int) -> bool:
    """Whether indexing a tensor of ``ndim`` dims with ``key`` reads its last dim whole (so the
    index commutes with a linear layer over that dim)."""
    entries = key if isinstance(key, tuple) else (key,)
    used = [_dims(e) for e in entries]
    ellipses = [i for i, e in enumerate(entries) if e is Ellipsis]
    if any(n is None for n in used) or len(ellipses) > 1:
        return False
    if not ellipses and sum(used) < ndim:  # the trailing dims are not indexed
        return True
    # what indexes the last dim: the last entry (after the ellipsis, if any), which must read it
    # whole, with no new dim (None) after it
    tail = entries[ellipses[0] + 1 :] if ellipses else entries
    return sum(used) <= ndim and (not tail or _whole(tail[-1]))


def _dims(entry: Any) -> int | None:
    """How many dims an index entry consumes; ``None``: an entry not followed."""
    if entry is None or entry is Ellipsis:
        return 0
    if isinstance(entry, (int, slice)) and not isinstance(entry, bool):
        return 1
    if isinstance(entry, torch.Tensor):
        return entry.dim() if entry.dtype == torch.bool else 1
    return None


def _whole(entry: Any) -> bool:
    return isinstance(entry, slice) and entry.start is None and entry.stop is None and entry.step is None


def wanted(flag: bool | None, state: Any) -> bool:
    """``compile_step(fused_loss=flag)`` for ``state``: ``None`` means where the fused kernels
    run, a state on CUDA (on the CPU the op runs its reference loop and gains nothing)."""
    return bool(state.step.is_cuda) if flag is None else flag
