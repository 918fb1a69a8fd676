"""What ``loss_fn`` returns, checked while a step is traced: a clear ``LossNotScalarError``
instead of a torch error deep in the backward."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fsg._src.errors import LossNotScalarError


def call_loss(loss_fn: Callable[..., Any], params: Any, batch: Any, buffers: Any) -> tuple[torch.Tensor, dict]:
    """Calls ``loss_fn`` (with the buffers when the state has any) and checks what it returned:
    ``loss`` or ``(loss, aux)``, the loss a 0-d floating-point tensor that depends on the
    parameters through differentiable ops, aux a dict of tensors named by strings."""
    out = loss_fn(params, batch, buffers) if buffers else loss_fn(params, batch)
    loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        what = (
            f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}"
        )
        raise LossNotScalarError(
            f"loss_fn must return a 0-d floating-point tensor, or (loss, aux) with aux a dict of "
            f"tensors; it returned {what}. Reduce the loss with .mean() or .sum()."
        )
    if not loss.requires_grad:  # eager PyTorch's loss.backward() fails here too, less clearly
        raise LossNotScalarError(
            "loss_fn returned a loss that does not depend on any trained parameter through differentiable "
            "ops (it has no grad_fn), so there is nothing to differentiate: it was computed under "
            "torch.no_grad() or torch.inference_mode(), detached (.detach(), .data, a round trip through "
            ".item() or numpy), or every parameter it reads is frozen (requires_grad=False). Compute it from "
            "the params loss_fn is given, with gradients enabled."
        )
    if not isinstance(aux, dict):
        raise LossNotScalarError(
            f"the aux output of loss_fn must be a dict of tensors (it becomes the step's metrics); "
            f"got {type(aux).__name__}. Return (loss, {{'name': tensor, ...}})."
        )
    for key, value in aux.items():
        if not isinstance(key, str):
            raise LossNotScalarError(f"the aux output of loss_fn has the key {key!r}; metric names are strings. Rename it.")
        if not isinstance(value, torch.Tensor):
            raise LossNotScalarError(
                f"the aux metric {key!r} returned by loss_fn is a {type(value).__name__} ({value!r:.40}), but every "
                f"aux value must be a tensor computed in the step (a Python value would be frozen into the graph). "
                f"Return it as a tensor (e.g. accuracy.float().mean()), or drop it from aux."
            )
    return loss, aux
