"""DTensor sharding rules for fsg's registered ops, so that a step on a mesh keeps them.

Stage 2 runs the traced step on DTensors; an op without a rule cannot run there, which is why
``fsg.nn`` traces plain math on a mesh (``plain_math()``). The ops below have rules and stay
fused on a mesh:

- ``fsg::linear_cross_entropy_sum(h, W, targets, ...) -> (loss_sum, dh, dW)``: rows are
  independent, so with the tokens sharded (``h`` and ``targets`` on dim 0, ``W`` whole) each
  rank computes its rows' loss sum and ``dh`` for its rows, and the loss sum and ``dW`` are
  partial sums over the ranks (``Partial``), reduced where they are needed. Otherwise
  everything is replicated (DTensor gathers inputs as needed, e.g. a vocabulary-sharded W).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fsg._src import _torch_private
from fsg._src.kernels import linear_cross_entropy  # noqa: F401 - registers the ops

LINEAR_CROSS_ENTROPY_SUM = torch.ops.fsg.linear_cross_entropy_sum.default


@_torch_private.register_sharding(LINEAR_CROSS_ENTROPY_SUM)
def _linear_cross_entropy_sum(h, weight, targets, ignore_index, z_loss, chunk, with_grad):
    scalars = [None, None, None, None]
    replicated = ([Replicate(), Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), *scalars])
    by_tokens = ([Partial(), Shard(0), Partial()], [Shard(0), Replicate(), Shard(0), *scalars])
    return [replicated, by_tokens]
