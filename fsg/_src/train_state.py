"""``TrainState``: everything a train step reads and writes, as one pytree of tensors."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class TrainState(NamedTuple):
    """The state of a training run: a pytree whose leaves are all tensors.

    Attributes:
      step: 0-d int64 tensor, the number of optimizer updates applied so far.
      params: the parameter pytree (``{name: tensor}`` from ``fsg.params``).
      opt_state: the optimizer's state pytree (``optimizer.init(params)``).
      rng: int64 tensor ``[seed, counter]``, the key of the step's random ops; the counter
        advances by one every step, so step ``t`` draws with ``(seed, t)``. Dropout, ``rand``,
        ``randn``, ``bernoulli``... in the loss are traced as hashes of this key, the op's call
        index and each element's global index (docs/models.md#randomness): a seed reproduces
        a run, a restored checkpoint resumes it, a mesh draws what one device draws.
      buffers: non-parameter state (``fsg.buffers``); ``{}`` when the model has none in use.

    Being a NamedTuple, it is a pytree for optree and ``torch.utils._pytree`` alike, and
    ``state._replace(params=...)`` builds a modified copy.
    """

    step: torch.Tensor
    params: Any
    opt_state: Any
    rng: torch.Tensor
    buffers: Any
