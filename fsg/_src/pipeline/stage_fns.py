"""Each stage's three compiled actions: forward ``F``, input gradient ``B``, weight gradient ``W``.

``F(*params, *batch, *acts) -> outputs`` is the stage graph itself. ``B`` and ``W`` take the
same inputs and the cotangents of the stage's differentiable outputs (the last stage: of its
loss, the microbatch's weight in the mean) and return the gradients of the activation inputs
and of the parameters. Both are traced (``make_fx`` over ``torch.autograd.grad``, as stage 1
traces the backward) and recompute the stage's forward: no activation is kept between the
actions but the stage's inputs, at the price of two extra forwards a microbatch (a debt of this
first slice; keeping the forward's residuals for ``B`` and ``W`` is the follow-up).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fsg._src import _torch_private
from fsg._src.backend.inductor import compile_graph
from fsg._src.pipeline.split import StageGraph


class StageFns(NamedTuple):
    """A stage's compiled actions and which of its tensors are differentiable."""

    forward: Callable[..., Any]
    backward_input: Callable[..., Any] | None  # None: no differentiable activation comes in (the first stage)
    backward_weight: Callable[..., Any]
    grad_inputs: tuple[bool, ...]  # per activation input: gets a gradient (sent back)
    grad_outputs: tuple[bool, ...]  # per output: takes a cotangent (received, or the loss's weight)


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def build(
    stage: StageGraph, params: list[torch.Tensor], batch: list[torch.Tensor], last: bool, backend: str
) -> StageFns:
    """Traces and compiles ``stage``'s actions for inputs like ``params`` and ``batch`` (its own
    leaves, in its order)."""
    device = params[0].device if params else batch[0].device
    acts = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in stage.inputs]
    outs = stage.outputs[:1] if last else stage.outputs
    grad_outputs = tuple(differentiable(t) for t in outs)
    cots = [torch.empty(t.shape, dtype=t.dtype, device=device) for t, d in zip(outs, grad_outputs) if d]
    grad_inputs = tuple(differentiable(t) for t in stage.inputs)
    n_p, n_b, n_a = len(params), len(batch), len(acts)

    def gradients(wrt_params: bool) -> Callable[..., tuple]:
        def fn(*flat):
            p, b, a, c = flat[:n_p], flat[n_p : n_p + n_b], flat[n_p + n_b : n_p + n_b + n_a], flat[n_p + n_b + n_a :]
            if wrt_params:
                p = [x.detach().requires_grad_(differentiable(x)) for x in p]
                wrt = [x for x in p if x.requires_grad]
            else:
                a = [x.detach().requires_grad_(g) for x, g in zip(a, grad_inputs)]
                wrt = [x for x in a if x.requires_grad]
            with torch.enable_grad():
                out = stage.graph(*p, *b, *a)
                pairs = [(o, g) for o, g in zip([o for o, d in zip(out, grad_outputs) if d], c) if o.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
            return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads))

        return fn

    example = [*params, *batch, *acts, *cots]
    backward_input = None
    if any(grad_inputs):
        backward_input = compile_graph(_torch_private.trace_fake(gradients(False), *example), backend)
    backward_weight = compile_graph(_torch_private.trace_fake(gradients(True), *example), backend)
    forward = compile_graph(_torch_private.trace_fake(stage.graph, *params, *batch, *acts), backend)
    return StageFns(forward, backward_input, backward_weight, grad_inputs, grad_outputs)
