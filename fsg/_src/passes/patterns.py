"""The aten ops that more than one pass matches by, defined once."""

from __future__ import annotations

import torch

aten = torch.ops.aten
GELU, GELU_BACKWARD, CAT = aten.gelu.default, aten.gelu_backward.default, aten.cat.default
MUL, SILU, SILU_BACKWARD = aten.mul.Tensor, aten.silu.default, aten.silu_backward.default
# the views that flatten or unflatten a tensor's leading dims (a pass sees through them)
FLATTENS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
