"""Marker ops that stage 1 leaves in the global graph for stage 2 to act on.

``fsg::param_use(p, leaf)`` marks where the loss reads parameter ``leaf`` (stage 2 gathers it
over data axes there, FSDP-style); ``fsg::grad(g, leaf)`` marks the gradient of parameter
``leaf`` right after backward (stage 2 constrains it to the parameter's placement). Both are
identities; on one device they are removed before compilation, so no kernel ever runs them.
"""

from __future__ import annotations

import torch
from torch import fx


@torch.library.custom_op("fsg::param_use", mutates_args=())
def param_use(x: torch.Tensor, leaf: int) -> torch.Tensor:
    return x.clone()


@param_use.register_fake
def _(x, leaf):
    return torch.empty_like(x)


def _param_use_backward(ctx, grad):
    return grad, None


param_use.register_autograd(_param_use_backward)


@torch.library.custom_op("fsg::grad", mutates_args=())
def grad(x: torch.Tensor, leaf: int) -> torch.Tensor:
    return x.clone()


@grad.register_fake
def _(x, leaf):
    return torch.empty_like(x)


PARAM_USE = torch.ops.fsg.param_use.default
GRAD = torch.ops.fsg.grad.default
MARKERS = (PARAM_USE, GRAD)


def strip(gm: fx.GraphModule) -> int:
    """Replaces every marker node by its input (the single-device path); returns how many."""
    stripped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in MARKERS:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            stripped += 1
    gm.recompile()
    return stripped
