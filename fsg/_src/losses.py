"""Reference (eager) losses; fused Triton versions replace them on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits[..., V]`` against integer ``targets[...]``.

    Computed in float32 whatever the logits' dtype. Targets equal to ``ignore_index`` do not
    count, in the sum nor in the mean's denominator (counted on device, no host sync).

    Args:
      logits: ``[..., V]`` unnormalized scores.
      targets: ``[...]`` class indices, integer dtype.
      ignore_index: the target value to skip.

    Returns:
      A float32 0-d tensor.

    Example:
      >>> fsg.nn.cross_entropy(torch.zeros(2, 4), torch.tensor([1, 3]))
      tensor(1.3863)
    """
    logits_NV = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(logits_NV, targets.reshape(-1), ignore_index=ignore_index)
