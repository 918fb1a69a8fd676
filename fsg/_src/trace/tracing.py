"""Stage 1: trace the whole train step into one aten FX graph.

``grad_and_value(loss_fn)``, the optimizer update and the step counter are traced together by
``make_fx`` on fake tensors, so the graph holds forward, backward and update ops and nothing
runs on real data while tracing. Inputs are the flat state leaves then the flat batch leaves.
With donation the graph writes each new state leaf into the old one with ``copy_`` and
returns only the metrics; without, it returns the new state leaves, then the metrics.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import fx

from fsg._src import frozen, recompute, tree
from fsg._src.errors import BatchError, FsgError, ImpureLossError, LossNotScalarError, StructureMismatchError
from fsg._src.kernels import sum_squares
from fsg._src.optim._base import GradientTransformation, apply_updates
from fsg._src.optim._complex import complex_like, real_views
from fsg._src.optim._transforms import learning_rate
from fsg._src.precision import Policy, at_least_float32
from fsg._src.trace import (
    accumulation,
    block_masks,
    epilogue,
    loss_output,
    markers,
    purity,
    random,
    refusals,
    resilience,
)
from fsg._src.trace.fused_loss import FusedLoss
from fsg._src.trace.subgraph_constants import inline_scalar_constants
from fsg._src.train_state import TrainState

LossFn = Callable[..., Any]
log = logging.getLogger("fsg")


class TracedStep(NamedTuple):
    """The output of stage 1: the global step graph and how to read its outputs."""

    graph_module: fx.GraphModule
    num_state_leaves: int
    metric_names: tuple[str, ...]
    donate: bool


def microbatches(batch: Any, accum_steps: int) -> Iterator[Any]:
    """``batch`` split into ``accum_steps`` microbatches along dim 0, each made when it is
    asked for (so a traced microbatch's copies come after the previous one's backward).

    Microbatch j takes rows j, j + k, j + 2k, ... (k = ``accum_steps``), written as a view
    ``[B/k, k, ...]`` and a select: each rank's contiguous rows of a batch sharded on dim 0
    stay on that rank, so splitting moves no data. Each leaf is then made contiguous, as a
    batch a user passes is: losses call ``.view`` on their inputs (Hugging Face's
    ``labels.view(-1)``), which a strided select would refuse.
    """
    if accum_steps == 1:
        return iter([batch])
    return (tree.tree_map(lambda x, j=j: x.unflatten(0, (x.shape[0] // accum_steps, accum_steps)).select(1, j).contiguous(), batch)
            for j in range(accum_steps))  # fmt: skip


def check_accumulation(batch: Any, accum_steps: int) -> None:
    """Raises ``BatchError`` naming a batch leaf whose dim 0 ``accum_steps`` does not divide."""
    if accum_steps < 1:
        raise BatchError(f"accum_steps must be at least 1, got {accum_steps}")
    if accum_steps == 1:  # nothing is split: any leaf will do, a 0-d one (a loss weight, say) too
        return
    leaves, _ = tree.flatten(batch)
    for path, leaf in zip(tree.leaf_paths(batch, "batch"), leaves):
        if leaf.dim() == 0 or leaf.shape[0] % accum_steps:
            rows = "a 0-d tensor" if leaf.dim() == 0 else f"{leaf.shape[0]} rows"
            raise BatchError(
                f"{path} has {rows}, which accum_steps={accum_steps} cannot split into equal "
                f"microbatches along dim 0; make the batch size a multiple of accum_steps"
            )


def _loss_and_grads(loss_fn, inputs, params_def, batch, buffers, precision, mark_uses, scale, fusing):
    with torch.enable_grad(), recompute.scope():  # (checkpointed module code reruns in the backward)
        # Mark each read of a parameter: stage 2 gathers data-sharded params there (FSDP),
        # after the cast to the compute dtype, so that gathers move the smaller dtype.
        mark = markers.param_use if mark_uses else (lambda p, i: p)
        used = [mark(precision.read_param(p), i) if p.requires_grad else p for i, p in enumerate(inputs)]
        # torch.autocast under Policy(autocast=True); the loss of a linear's logits fused (fused_loss.py)
        with precision.region(inputs[0].device), fusing or contextlib.nullcontext(), frozen.tracking(used) as found:
            loss, aux = loss_output.call_loss(loss_fn, tree.unflatten(params_def, used), precision.cast_compute(batch), buffers)
        differentiable = [p for p in inputs if p.requires_grad]
        scaled = loss if scale is None else loss.float() * scale  # float16: the loss scale (resilience.py)
        with recompute.backward():
            raw = iter(torch.autograd.grad(scaled, differentiable, allow_unused=True) if differentiable else ())
    return loss, aux, [next(raw) if p.requires_grad else None for p in inputs], found


def train_step(
    loss_fn: LossFn,
    optimizer: GradientTransformation,
    state: TrainState,
    batch: Any,
    precision: Policy = Policy(),  # noqa: B008 - an immutable NamedTuple
    accum: tuple[int, Callable[[Any], torch.Tensor] | None] = (1, None),
    mark_uses: bool = False,
    mark_grads: bool = False,
    skip: bool = False,
    fusing: FusedLoss | None = None,
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """One train step as a pure function of tensors: what stage 1 traces.

    Returns the new state and the metrics (``loss``, ``grad_norm``, ``lr`` when the optimizer
    has a learning rate, and the aux outputs of ``loss_fn``). With ``accum = (k, weight)``,
    k > 1, the gradients, loss and aux are means over k microbatches, weighted by
    ``weight(microbatch)`` when given (``accumulation.py``). With ``skip`` (always
    with a loss scale) a non-finite step leaves params, optimizer state and buffers as they
    were and is counted in ``state.skips`` and ``metrics["skipped"]`` (docs/resilience.md).
    ``fusing`` (a ``FusedLoss`` mode) traces the cross-entropies of linear layers' logits fused.
    """
    config = precision.loss_scale
    resilience.check_state(state, skip=skip, config=config)
    scale = resilience.scale_of(state, config)

    param_leaves, params_def = tree.flatten(state.params)
    precision = precision.resolve(param_leaves)
    # Differentiate with torch.autograd (recorded by make_fx like any other op); the marker
    # ops stage 2 needs carry autograd formulas that functorch transforms cannot run.
    inputs = [p.detach().requires_grad_(p.is_floating_point() or p.is_complex()) for p in param_leaves]
    accum_steps, weigh = accum
    micro = microbatches(batch, accum_steps)
    # The loss's modules update buffers in place (BatchNorm's running statistics): on copies,
    # which become the new state, so the step's inputs are written only by donation.
    buffers = tree.tree_map(torch.clone, state.buffers)  # trace() drops the copies never written
    mean = accumulation.Mean(len(inputs), weigh if accum_steps > 1 else None)
    frozen_leaves: set[int] = set()
    with random.keyed(state.rng):  # random ops draw from the step's key (seed, counter), not torch's generator
        for mb in micro:  # unrolled: each microbatch's activations die after its backward
            mb_loss, mb_aux, mb_grads, mb_frozen = _loss_and_grads(
                loss_fn, inputs, params_def, mb, buffers, precision, mark_uses, scale, fusing
            )
            frozen_leaves |= mb_frozen
            mean.add(mb, mb_loss, mb_aux, mb_grads)
    loss, aux, sums = mean.result()  # the mean over microbatches, as the loss over the whole batch
    if scale is not None:  # unscaled before the markers: stage 2 and the fused update see true gradients
        sums = [None if g is None else g / scale.to(g.dtype) for g in sums]
    kept = frozen_leaves | {i for i, g in enumerate(sums) if g is None}  # frozen, or not reached by the loss
    grad_leaves = []
    for i, (p, g) in enumerate(zip(inputs, sums)):
        g = torch.zeros_like(p) if g is None else g
        # Mark each gradient: stage 2 constrains it to its parameter's placement (rule 2); a kept one is zeros
        grad_leaves.append(markers.grad(g, i) if mark_grads and i not in kept else g)
    grads = tree.unflatten(params_def, grad_leaves)
    # complex parameters: the optimizer sees real views, as in torch.optim (optim/_complex.py)
    updates, opt_state = optimizer.update(real_views(grads), state.opt_state, real_views(state.params))
    updates = complex_like(updates, state.params)
    params = apply_updates(state.params, updates)
    params, opt_state = frozen.keep((params, opt_state), (state.params, state.opt_state), params_def, frozen_leaves, kept)
    # fsg.optim.global_norm's math, one launch where fused kernels run (kernels/sum_squares.py)
    grad_norm = sum_squares.global_norm(real_views([g for i, g in enumerate(grad_leaves) if i not in kept] or grad_leaves))
    metrics = {"loss": loss.detach().to(at_least_float32(loss.dtype)), "grad_norm": grad_norm}
    lr = learning_rate(opt_state)
    if lr is not None:
        metrics["lr"] = lr
    builtin = {*metrics, *(("skipped",) if skip or config is not None else ()), *(("loss_scale",) if config else ())}
    for name, value in aux.items():
        if name in builtin:
            raise LossNotScalarError(
                f"the aux output of loss_fn has the key {name!r}, which names a built-in metric; "
                f"rename it (built-in metrics: {sorted(builtin)})."
            )
        metrics[name] = value.detach()
    rng = torch.cat([state.rng[:1], state.rng[1:] + 1])  # (seed, counter + 1)
    skips, loss_scale = state.skips, state.loss_scale
    if skip or config is not None:
        finite = resilience.is_finite(metrics["loss"], metrics["grad_norm"])
        params, opt_state, buffers = resilience.keep_if_skipped(
            finite, (params, opt_state, buffers), (state.params, state.opt_state, state.buffers)
        )
        skips = resilience.next_skips(finite, state.skips)
        metrics["skipped"] = skips.skipped
        if config is not None:
            metrics["loss_scale"] = scale.clone()  # the scale this step used (the input is overwritten)
            loss_scale = resilience.next_loss_scale(finite, state.loss_scale, config)
    new_state = TrainState(state.step + 1, params, opt_state, rng, buffers, skips, loss_scale)
    return new_state, metrics


def trace(
    loss_fn: LossFn,
    optimizer: GradientTransformation,
    state: TrainState,
    batch: Any,
    *,
    donate: bool,
    precision: Policy = Policy(),  # noqa: B008 - an immutable NamedTuple
    accum_steps: int = 1,
    microbatch_weight: Callable[[Any], torch.Tensor] | None = None,
    mark_uses: bool = False,
    mark_grads: bool = False,
    source_lines: bool = False,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
    skip: bool = False,
    fused_loss: bool = False,
) -> TracedStep:
    """Stage 1: traces one train step on ``state`` and ``batch`` into a ``TracedStep``.

    ``mark_uses`` / ``mark_grads`` trace the ``fsg::param_use`` / ``fsg::grad`` marker nodes:
    stage 2 needs both, the fusion pass the gradients'; whoever asks for them strips them
    (``markers.strip``) when done. Tracing them costs ~3 ms each, so one device skips them.
    ``source_lines`` records each node's user stack (stage 2 names the line in its errors).
    ``decompositions`` lowers ops while tracing (on a mesh: ``op_support.mesh_decompositions``).
    ``fused_loss`` traces a cross-entropy of a linear layer's logits as ``linear_cross_entropy``
    (``fused_loss.py``).
    """
    check_accumulation(batch, accum_steps)
    state_leaves, state_def = tree.flatten(state)
    batch_leaves, batch_def = tree.flatten(batch)
    n_state = len(state_leaves)
    metric_names: list[str] = []
    fusing = FusedLoss() if fused_loss else None

    def flat_step(*flat):
        old_leaves = flat[:n_state]
        new_state, metrics = train_step(
            loss_fn,
            optimizer,
            tree.unflatten(state_def, old_leaves),
            tree.unflatten(batch_def, flat[n_state:]),
            precision,
            (accum_steps, microbatch_weight),
            mark_uses,
            mark_grads,
            skip,
            fusing,
        )
        new_leaves, new_def = tree.flatten(new_state)
        if new_def != state_def:
            raise StructureMismatchError(
                f"the optimizer changed the structure of the state: {state_def} -> {new_def}. "
                f"GradientTransformation.update must return a state shaped like its input."
            )
        metric_names[:] = sorted(metrics)
        values = tuple(metrics[name] for name in metric_names)
        if not donate:
            return (*new_leaves, *values)
        for old, new in zip(old_leaves, new_leaves):
            if new is not old:
                old.copy_(new)
        return values

    def violation() -> FsgError | None:
        return purity.diagnose(loss_fn, state.params, batch, state.buffers)

    try:
        gm = purity.trace(flat_step, *state_leaves, *batch_leaves, source_lines=source_lines, decompositions=decompositions)
    except FsgError:
        raise
    except TypeError as exc:  # a list or tuple of the batch handed to an op that takes a tensor
        misuse = refusals.container_misuse(exc, batch)
        if misuse is None:
            raise
        raise misuse from exc
    except RuntimeError as exc:
        if "in-place" in str(exc) or "inplace" in str(exc):
            found = violation()
            if found is not None:
                raise found from exc
        raise

    if (dynamic := refusals.dynamic_shape_op(gm)) is not None:
        where = purity.locate(loss_fn, state.params, batch, state.buffers, dynamic)
        raise refusals.dynamic_shape_error(dynamic, where or "(source line unknown)")
    batch_inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"][n_state:]
    if purity.has_host_sync(gm) or purity.writes_to_inputs(gm, set(batch_inputs)):
        # The graph breaks a rule; re-run the loss alone to find the source line.
        raise violation() or ImpureLossError(
            "loss_fn reads a tensor value on the host or writes to a batch leaf in place; "
            "see the step graph (step.lower(state, batch).as_text()) for the op."
        )
    if fusing is not None and fusing.rewritten:  # the logits' linear is dead now: drop it before functionalizing
        gm.graph.eliminate_dead_code()
        gm.recompile()
        log.info("fsg: stage 1: %d cross-entropy loss(es) traced fused with their output projection", fusing.rewritten)
    # a module buffer written but not in the state, a parameter read outside fsg.apply: refused by name
    purity.check_constants(gm, lambda op: purity.locate(loss_fn, state.params, batch, state.buffers, op))
    gm = epilogue.functionalize(gm, donate=donate, decompositions=decompositions)
    inline_scalar_constants(gm)  # a mask_mod's lengths[0]: Inductor's retrace fails on it
    if folded := block_masks.fold(gm):
        log.info("fsg: stage 1: %d FlexAttention call(s) read a block mask computed once, not each step", folded)
    gm.meta["num_state_leaves"] = n_state  # where the inputs turn from state to batch (Lowered.memory)
    return TracedStep(gm, n_state, tuple(metric_names), donate)
