"""Traceable stand-ins for torch code that a trace cannot run as written.

A few of torch's own modules and losses bring a tensor to Python where the computation needs
no such thing, or talk to a process group themselves, so a loss that uses them unchanged could
not be traced into a static graph (``torch.compile`` runs them with a graph break). While fsg
traces, each is replaced by the same computation in tensor ops:

- ``BatchNorm{1,2,3}d(momentum=None)`` (a cumulative moving average of the statistics) computes
  its factor as ``1.0 / float(num_batches_tracked)``; here it is a 0-d tensor, and the running
  statistics are updated with it as torch's kernel does (``(1 - f) * running + f * batch``,
  the variance unbiased).
- ``SyncBatchNorm`` gathers each rank's statistics over its process group itself (GPU only).
  fsg traces the global step, in which a BatchNorm already normalizes by the statistics of the
  whole global batch, so it runs as a BatchNorm; one given a ``process_group`` of its own
  (statistics over a subset of the ranks) is refused.
- ``F.gaussian_nll_loss`` (and ``nn.GaussianNLLLoss``) raises on a negative variance with
  ``if torch.any(var < 0)``; here a negative variance makes the loss NaN instead, which a
  step reports or skips like any non-finite loss (``fsg.compile_step(skip_nonfinite=...)``).

Each stand-in equals torch's on every input torch accepts (``tests/test_stand_ins.py``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fsg._src.errors import UnsupportedError

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FORWARD = nn.BatchNorm2d.forward  # torch's, the three classes share it
_GAUSSIAN_NLL = F.gaussian_nll_loss


@contextlib.contextmanager
def traceable() -> Iterator[None]:
    """Within: the stand-ins replace torch's functions (for a trace on fake tensors)."""
    saved = [(cls, cls.__dict__.get("forward")) for cls in (*_BATCH_NORMS, nn.SyncBatchNorm)]
    for cls in _BATCH_NORMS:
        cls.forward = _batch_norm_forward
    nn.SyncBatchNorm.forward = _sync_batch_norm_forward
    F.gaussian_nll_loss = gaussian_nll_loss
    try:
        yield
    finally:
        F.gaussian_nll_loss = _GAUSSIAN_NLL
        for cls, forward in saved:
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward


def _batch_norm_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    if self.momentum is None and self.training and self.track_running_stats:
        return cumulative_batch_norm(self, input)
    return _FORWARD(self, input)


def _sync_batch_norm_forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    group = self.process_group
    if group is not None and torch.distributed.get_world_size(group) != torch.distributed.get_world_size():
        raise UnsupportedError(
            "a SyncBatchNorm with a process_group of its own, not all ranks: fsg traces the global step, in which a "
            "BatchNorm normalizes by the statistics of the whole global batch (as SyncBatchNorm over all "
            "ranks), and cannot narrow them to a subset of the ranks. Leave process_group=None, or "
            "use plain BatchNorm: on a data mesh it syncs over the mesh."
        )
    return _batch_norm_forward(self, input)  # (which checks the input's dims with SyncBatchNorm's check)


def cumulative_batch_norm(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``module(input)`` for a BatchNorm with ``momentum=None`` in training mode: normalized
    by the batch's statistics, the running ones updated by their cumulative average, the
    factor ``1 / num_batches_tracked`` a tensor."""
    module._check_input_dim(input)
    module.num_batches_tracked.add_(1)
    out = F.batch_norm(input, None, None, module.weight, module.bias, True, 0.0, module.eps)
    with torch.no_grad():
        running_mean, running_var = module.running_mean, module.running_var
        x = input.detach().to(running_mean.dtype)
        dims = [d for d in range(x.dim()) if d != 1]
        factor = module.num_batches_tracked.to(torch.float64).reciprocal().to(running_mean.dtype)
        running_mean.mul_(1 - factor).add_(x.mean(dims) * factor)
        running_var.mul_(1 - factor).add_(x.var(dims, correction=1) * factor)
    return out


def gaussian_nll_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    var: torch.Tensor | float,
    full: bool = False,
    eps: float = 1e-6,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.gaussian_nll_loss`` without a host read: NaN where torch raises on a negative
    ``var`` (a float ``var`` is checked in Python, as torch does)."""
    if not isinstance(var, torch.Tensor):  # a float: checked in Python
        return _GAUSSIAN_NLL(input, target, var, full=full, eps=eps, reduction=reduction)
    if var.size() != input.size():
        if input.size()[:-1] == var.size():  # homoscedastic: one variance per row
            var = var.unsqueeze(-1)
        elif not (input.ndim == var.ndim and sum(v for i, v in zip(input.size(), var.size()) if i != v) == 1):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    negative = (var < 0).any()
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    loss = loss.masked_fill(negative, math.nan)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss
