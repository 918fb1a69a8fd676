"""``TrainState``: everything a train step reads and writes, as one pytree of tensors."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class SkipState(NamedTuple):
    """How many steps were skipped for a non-finite loss or gradient (docs/resilience.md).

    Attributes:
      skipped: 0-d int64, every skipped step of the run.
      consecutive: 0-d int64, the skips in a row up to the last step (0 after an applied one).
    """

    skipped: torch.Tensor
    consecutive: torch.Tensor


class LossScaleState(NamedTuple):
    """The dynamic loss scale of a float16 run (``fsg.Policy(compute=torch.float16)``).

    Attributes:
      scale: 0-d float32, what the loss is multiplied by before the backward.
      good_steps: 0-d int64, finite steps since the scale last changed.
    """

    scale: torch.Tensor
    good_steps: torch.Tensor


class TrainState(NamedTuple):
    """The state of a training run: a pytree whose leaves are all tensors.

    Attributes:
      step: 0-d int64 tensor, the number of steps taken so far (skipped ones included:
        ``step - skips.skipped`` updates were applied).
      params: the parameter pytree (``{name: tensor}`` from ``fsg.params``).
      opt_state: the optimizer's state pytree (``optimizer.init(params)``).
      rng: int64 tensor ``[seed, counter]``, the key of the step's random ops; the counter
        advances by one every step, so step ``t`` draws with ``(seed, t)``. Dropout, ``rand``,
        ``randn``, ``bernoulli``... in the loss are traced as hashes of this key, the op's call
        index and each element's global index (docs/models.md#randomness): a seed reproduces
        a run, a restored checkpoint resumes it, a mesh draws what one device draws.
      buffers: non-parameter state (``fsg.buffers``); ``{}`` when the model has none in use.
      skips: a ``SkipState`` (``step.init`` always builds one), or ``()`` in a state built by
        hand, which a step that skips non-finite steps refuses.
      loss_scale: a ``LossScaleState`` when the step's ``Policy`` scales the loss (float16
        compute), ``()`` otherwise. Both are saved and restored with the checkpoint.

    Being a NamedTuple, it is a pytree for optree and ``torch.utils._pytree`` alike, and
    ``state._replace(params=...)`` builds a modified copy.
    """

    step: torch.Tensor
    params: Any
    opt_state: Any
    rng: torch.Tensor
    buffers: Any
    skips: Any = ()
    loss_scale: Any = ()
