"""Using an ``nn.Module`` as a pure function of its parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Returns the parameters of ``model`` as a flat dict of detached tensors.

    Tied weights (one ``nn.Parameter`` reachable under several names) are stored once, under
    the first name ``named_parameters()`` yields; ``apply`` re-ties them.

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


def apply(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    *args: Any,
    buffers: dict[str, torch.Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """Calls ``model(*args, **kwargs)`` with ``params`` (and ``buffers``) in place of its own.

    The module is only a template: its own parameter values are never read. Buffers default
    to the module's own, which a compiled step then holds as constants.

    Args:
      model: the module whose ``forward`` to run.
      params: ``{name: tensor}`` as returned by ``fsg.params``.
      *args: positional arguments of ``forward``.
      buffers: optional ``{name: tensor}`` replacing the module's buffers.
      **kwargs: keyword arguments of ``forward``.

    Returns:
      Whatever ``forward`` returns.

    Example:
      >>> lin = torch.nn.Linear(2, 3)
      >>> fsg.apply(lin, fsg.params(lin), torch.ones(4, 2)).shape
      torch.Size([4, 3])
    """
    tensors = dict(params) if not buffers else {**params, **buffers}
    return torch.func.functional_call(model, tensors, args, kwargs, tie_weights=True, strict=False)
