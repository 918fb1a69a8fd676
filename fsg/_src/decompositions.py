"""Decompositions fsg traces with everywhere: corrections of torch's own.

torch's decomposition tables are used by ``torch.compile`` (AOTAutograd, Inductor) and by
stage 1 on a mesh. Where one of them computes something other than its op, a compiled step
would train silently wrong; fsg traces the op with a correct decomposition instead, so
neither stage 2 nor Inductor ever sees it. Each entry names the torch issue and is tested
against the eager op (``tests/test_decompositions.py``).
"""

from __future__ import annotations

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


CORRECTIONS: dict[Any, Callable[..., Any]] = {
    _aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
}
