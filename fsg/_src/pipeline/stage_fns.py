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

from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from fsg._src import _torch_private
from fsg._src.backend.inductor import compile_graph
from fsg._src.pipeline import data_axes
from fsg._src.pipeline.data_axes import DataMesh
from fsg._src.pipeline.split import StageGraph


class StageFns(NamedTuple):
    """A stage's compiled actions and which of its tensors are differentiable."""

    forward: Callable[..., Any]
    backward_input: Callable[..., Any] | None  # None: no differentiable activation comes in (the first stage)
    backward_weight: Callable[..., Any]
    grad_inputs: tuple[bool, ...]  # per activation input: gets a gradient (sent back)
    grad_outputs: tuple[bool, ...]  # per output: takes a cotangent (received, or the loss's weight)
    input_like: tuple[torch.Tensor, ...]  # an empty tensor of each activation input's (local) shape
    output_like: tuple[torch.Tensor, ...]  # of each output's
    weight_placements: dict | None  # on a data mesh: param index -> its W output's placement (partial: reduce it)


class Forward(NamedTuple):
    """A stage's forward graph on this rank, and where its outputs live (on a data mesh)."""

    graph: Any  # an fx.GraphModule
    placements: tuple[tuple[Placement, ...], ...] | None
    output_like: tuple[torch.Tensor, ...]


def forward(
    stage: StageGraph,
    params: list[torch.Tensor],
    batch: list[torch.Tensor],
    last: bool,
    data: DataMesh | None = None,
    placements: Sequence[tuple[Placement, ...]] = (),
) -> Forward:
    """The stage's forward traced on global inputs like ``params``, ``batch`` and its
    activation inputs; on a data mesh expanded over it, ``placements`` those of its batch then
    activation inputs (every rank traces every stage's: the next stage takes its outputs'
    placements)."""
    device = params[0].device if params else batch[0].device
    acts = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in stage.inputs]
    gm = _torch_private.trace_fake(stage.graph, *params, *batch, *acts)
    if data is None:
        return Forward(gm, None, tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in stage.outputs))
    rep = (Replicate(),) * len(data.shape)

    def place(i, out):  # the last stage's loss and aux replicated (the metrics); activations un-partialed
        return out.redistribute(data.device_mesh, rep) if last else data_axes.replicated(out, data)

    expanded = data_axes.expand(gm, [*params, *batch, *acts], [rep] * len(params) + list(placements), data, place)
    return Forward(expanded.graph, expanded.placements, expanded.local_outputs)


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def build(
    stage: StageGraph,
    params: list[torch.Tensor],
    batch: list[torch.Tensor],
    last: bool,
    backend: str,
    fwd: Forward,
    data: DataMesh | None = None,
    placements: Sequence[tuple[Placement, ...]] = (),
) -> StageFns:
    """Traces and compiles ``stage``'s actions for global inputs like ``params`` and ``batch``
    (its own leaves, in its order), ``fwd`` its forward (``forward``); on a data mesh,
    ``placements`` are its batch then activation inputs' (the previous stage's outputs')."""
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
    b_graph = _torch_private.trace_fake(gradients(False), *example) if any(grad_inputs) else None
    w_graph = _torch_private.trace_fake(gradients(True), *example)
    input_like, weight_placements = tuple(acts), None
    if data is not None:
        rep = (Replicate(),) * len(data.shape)
        cot_placements = [p for p, d in zip(fwd.placements[: len(outs)], grad_outputs) if d]
        every = [rep] * n_p + list(placements) + cot_placements
        act_placements = list(placements[n_b:])
        if b_graph is not None:  # each input gradient where its activation came from
            wanted = [p for p, g in zip(act_placements, grad_inputs) if g]
            b_graph = data_axes.expand(
                b_graph, example, every, data, lambda i, o: o.redistribute(data.device_mesh, wanted[i])
            ).graph

        # shards gathered; a partial sum stays local: reduced once a step (data_axes.reduce_gradient)
        w = data_axes.expand(w_graph, example, every, data, lambda i, out: data_axes.replicated(out, data, Shard))
        trained = [i for i, p in zip(stage.params, params) if differentiable(p)]
        w_graph, weight_placements = w.graph, dict(zip(trained, w.placements))
        input_like = tuple(data_axes.local_like(a, p, data) for a, p in zip(acts, act_placements))
    backward_input = None if b_graph is None else compile_graph(b_graph, backend)
    return StageFns(
        compile_graph(fwd.graph, backend),
        backward_input,
        compile_graph(w_graph, backend),
        grad_inputs,
        grad_outputs,
        input_like,
        fwd.output_like,
        weight_placements,
    )
